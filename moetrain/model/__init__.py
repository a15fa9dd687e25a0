"""The language model: single-device math, built on meta, materialized, then initialized."""
