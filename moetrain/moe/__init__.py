"""Single-device mixture of experts: router -> dispatcher -> grouped experts -> combine."""
