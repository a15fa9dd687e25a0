"""Throughput of `moetrain prepare` with a Hugging Face fast tokenizer, by number of workers.

    python benchmarks/tokenize_bench.py [--mb 80] [--workers 1 2] [--dir /tmp/moetrain-tokbench]

CPU only, offline. The text is the embedded corpus (`moetrain.data.embedded_documents`, ~8 MB
of English and Python), repeated to `--mb` MB in one JSON lines file. The tokenizer is a
GPT-2-style byte-level BPE (the GPT-2 split regex, `--vocab` ids, <|endoftext|>) trained here
with `tokenizers` on the embedded corpus once, since nothing may be downloaded. Each count of
workers runs the real command, `python -m moetrain prepare CORPUS --tokenizer TOKENIZER
--workers N --out DIR --quiet --overwrite`, in a fresh process, timed by the wall clock from
start to exit (start-up, planning, tokenizing, assembling the token directory), best of
`--repeat`, and by the CPU time of the command and all its worker processes (user + system).
Reported: input MB/s by the wall clock; MB per CPU second, which is MB/s per core and, unlike
the wall clock, holds on a machine other work shares; and the tokenizer alone on one core
(`Tokenizer.encode` over the embedded documents in this process, no I/O, by CPU time) as the
ceiling per core.
The runs must write bitwise the same token directory; the script checks it. The machine's load
average is printed with each run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from moetrain.data import embedded_documents


def make_corpus(path: Path, megabytes: float) -> None:
    if path.is_file() and path.stat().st_size >= megabytes * 1e6:
        return
    docs = embedded_documents()
    written, copy = 0, 0
    with open(path.with_suffix(".tmp"), "w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            for text in docs:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line.encode())
            copy += 1
    path.with_suffix(".tmp").rename(path)


def train_tokenizer(path: Path, vocab_size: int) -> None:
    if path.is_file():
        return
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    gpt2_split = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(gpt2_split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(embedded_documents(), trainer)
    tok.save(str(path))


def tokenizer_alone_mb_s(tokenizer: Path, docs: list[str]) -> float:
    from moetrain.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer)
    start = time.process_time()  # CPU time: holds on a shared machine
    for text in docs:
        tok.encode_array(text)
    return sum(len(t.encode()) for t in docs) / 1e6 / (time.process_time() - start)


def _children_cpu_seconds() -> float:
    """User + system time of the finished children, their own children included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def digest(directory: Path) -> str:
    h = hashlib.sha256()
    for name in ("meta.json", "train.npy", "val.npy"):
        h.update((directory / name).read_bytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=80.0, help="corpus size in MB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/moetrain-tokbench"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer = args.dir / "corpus.jsonl", args.dir / "tokenizer.json"
    make_corpus(corpus, args.mb)
    train_tokenizer(tokenizer, args.vocab)
    megabytes = corpus.stat().st_size / 1e6
    alone = tokenizer_alone_mb_s(tokenizer, embedded_documents())
    print(f"corpus {megabytes:.1f} MB; tokenizer alone, one core: {alone:.2f} MB/s")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    digests = set()
    for workers in args.workers:
        out = args.dir / f"tokens-{workers}"
        best = best_cpu = float("inf")
        for _ in range(args.repeat):
            load = os.getloadavg()[0]
            command = [
                *(sys.executable, "-m", "moetrain", "prepare", str(corpus)),
                *("--tokenizer", str(tokenizer), "--workers", str(workers)),
                *("--out", str(out), "--quiet", "--overwrite"),
            ]
            cpu = _children_cpu_seconds()
            start = time.perf_counter()
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            seconds = time.perf_counter() - start
            cpu = _children_cpu_seconds() - cpu
            best = min(best, seconds)
            best_cpu = min(best_cpu, cpu)
            print(
                f"  workers {workers}: {seconds:.1f} s, {cpu:.1f} CPU s (load before: {load:.1f})"
            )
        digests.add(digest(out))
        print(
            f"workers {workers}: {best:.1f} s, {megabytes / best:.2f} MB/s; "
            f"{megabytes / best_cpu:.2f} MB per CPU second"
        )
    assert len(digests) == 1, f"the token directories differ: {digests}"
    print(f"token directories identical across worker counts: {digests.pop()}")
    print("command: " + " ".join(command).replace(str(args.dir), "$DIR"))


if __name__ == "__main__":
    main()
