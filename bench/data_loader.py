"""Data loader benchmark: redundant loader elimination and asynchronous preprocessing.

1. Four local ranks (gloo) read the default corpus with one reader per node
   (`data.reader=node`) and with one reader per rank (`data.reader=rank`), in one run, for two
   layouts: tp=4 (MegaScale's case: a node is one tensor-parallel group) and tp=2 x dp=2.
   Per node: bytes the loaders read (psutil `read_chars`, the bytes read(2)/pread(2) returned)
   and bytes read from the disk (`read_bytes`, with the shards evicted from the page cache
   before each run), resident and proportional memory (RSS, PSS) summed over the ranks.
2. One process: the fraction of step time spent waiting for data with `data.prefetch` on and
   off; runs alternate. The step is simulated two ways: a sleep (the host idles while the GPU
   computes or a collective runs, MegaScale's case) and a GEMM loop (a CPU-bound step, where
   the loader thread competes with the step for the cores and the GIL).

    python bench/data_loader.py [--steps 40] [--seq-len 1024] [--global-batch 64]

Writes bench/results/data_loader.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import psutil
import torch

from megascale.config import load_config
from megascale.data import build_loaders, ensure_default_corpus
from megascale.data.shards import read_manifest
from megascale.parallel import init_mesh
from megascale.testing.launch import run_local

RESULTS = Path(__file__).parent / "results" / "data_loader.json"


def job(args: argparse.Namespace, **extra: object) -> object:
    values = {
        "data.cache_dir": args.cache_dir,
        "model.seq_len": args.seq_len,
        "train.global_batch": args.global_batch,
        "train.micro_batch": args.micro_batch,
        "train.eval_batches": 1,
        "model.heads": 8,
        **extra,
    }
    return load_config(None, [f"--{k}={_toml(v)}" for k, v in values.items()])


def _toml(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else f"'{v}'" if isinstance(v, str) else str(v)


def evict(root: Path) -> None:
    """Drop our shard files from the page cache, so that disk reads are real reads."""
    for shard in read_manifest(root)["shards"]:
        fd = os.open(root / shard["file"], os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def gemm_step(seconds: float, size: int = 256) -> None:
    """A simulated training step: GEMMs for about `seconds`."""
    a = torch.randn(size, size)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


# -- part 1: per-node reads and memory ------------------------------------------------------
def _rank(args: argparse.Namespace, reader: str, tp: int, dp: int) -> dict:
    cfg = job(args, **{"data.reader": reader, "parallel.tp": tp, "parallel.dp": dp, "data.prefetch": True})
    proc = psutil.Process()
    mesh = init_mesh(cfg.parallel, device="cpu")
    io0 = proc.io_counters()
    train, _ = build_loaders(cfg, mesh)
    torch.distributed.barrier()
    io1 = proc.io_counters()
    waits, start = [], time.perf_counter()
    for _ in range(args.steps):
        batch = train.next_batch()
        waits.append(train.wait_seconds)
        time.sleep(args.step_s)  # the step; the loader reads ahead meanwhile
        assert batch is not None
    elapsed = time.perf_counter() - start
    torch.distributed.barrier()
    io2, mem = proc.io_counters(), proc.memory_full_info()
    train.close()
    mesh.destroy()
    return {
        "startup_read_chars": io1.read_chars - io0.read_chars,
        "read_chars": io2.read_chars - io1.read_chars,
        "read_bytes": io2.read_bytes - io0.read_bytes,
        "rss": mem.rss,
        "pss": mem.pss,
        "uss": mem.uss,
        "wait_fraction": sum(waits) / elapsed,
    }


def node_totals(args: argparse.Namespace, reader: str, tp: int, dp: int, root: Path) -> dict:
    evict(root)
    ranks = run_local(_rank, 4, (args, reader, tp, dp), env={"LOCAL_WORLD_SIZE": "4"}, timeout_s=600)
    total = {k: sum(r[k] for r in ranks) for k in ranks[0] if k != "wait_fraction"}
    total["max_wait_fraction"] = max(r["wait_fraction"] for r in ranks)
    total["per_rank_read_chars"] = [r["read_chars"] for r in ranks]
    return total


# -- part 2: waiting for data with and without prefetch ---------------------------------------
def wait_fraction(args: argparse.Namespace, prefetch: bool, step: str) -> dict:
    train, _ = build_loaders(job(args, **{"data.prefetch": prefetch, "data.reader": "rank"}), None)
    train.next_batch()  # warm-up (first read, thread start)
    waits, start = 0.0, time.perf_counter()
    for _ in range(args.steps):
        train.next_batch()
        waits += train.wait_seconds
        if step == "gemm":
            gemm_step(args.step_s)
        else:
            time.sleep(args.step_s)
    elapsed = time.perf_counter() - start
    train.close()
    return {"wait_s": waits, "step_s": elapsed / args.steps, "wait_fraction": waits / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.05, help="simulated step time")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of part 2")
    parser.add_argument("--cache-dir", default=".cache/megascale")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = ensure_default_corpus(args.cache_dir)

    loaders: dict[str, dict] = {}
    for tp, dp in ((4, 1), (2, 2)):
        layout = f"tp{tp}xdp{dp}"
        node = node_totals(args, "node", tp, dp, root)
        rank = node_totals(args, "rank", tp, dp, root)
        loaders[layout] = {
            "one_reader_per_node": node,
            "one_reader_per_rank": rank,
            "read_chars_ratio": node["read_chars"] / rank["read_chars"],
            "startup_read_chars_ratio": node["startup_read_chars"] / rank["startup_read_chars"],
            "disk_read_bytes_ratio": node["read_bytes"] / max(rank["read_bytes"], 1),
            "rss_ratio": node["rss"] / rank["rss"],
            "pss_ratio": node["pss"] / rank["pss"],
        }
        print(
            f"{layout}: loader reads per node, node reader / per-rank readers = "
            f"{loaders[layout]['read_chars_ratio']:.3f} during steps "
            f"({node['read_chars'] / 2**20:.1f} vs {rank['read_chars'] / 2**20:.1f} MiB), "
            f"{loaders[layout]['startup_read_chars_ratio']:.3f} at start-up (checksums); "
            f"disk {node['read_bytes'] / 2**20:.1f} vs {rank['read_bytes'] / 2**20:.1f} MiB; "
            f"RSS {node['rss'] / 2**20:.0f} vs {rank['rss'] / 2**20:.0f} MiB, "
            f"PSS {node['pss'] / 2**20:.0f} vs {rank['pss'] / 2**20:.0f} MiB",
            flush=True,
        )

    prefetch: dict[str, dict] = {}
    for step in ("sleep", "gemm"):
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                runs[mode].append(wait_fraction(args, mode == "on", step))
        prefetch[step] = {
            mode: {
                "wait_fraction": sum(r["wait_fraction"] for r in rs) / len(rs),
                "step_s": sum(r["step_s"] for r in rs) / len(rs),
                "runs": rs,
            }
            for mode, rs in runs.items()
        }
        on, off = prefetch[step]["on"], prefetch[step]["off"]
        print(
            f"{step} step: waiting for data {on['wait_fraction']:.2%} of step time with "
            f"prefetch, {off['wait_fraction']:.2%} without (step {on['step_s'] * 1e3:.0f} ms, "
            f"{args.global_batch} x {args.seq_len} tokens)",
            flush=True,
        )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "args": vars(args),
                "corpus_tokens": read_manifest(root)["tokens"],
                "loaders_4_local_ranks": loaders,
                "prefetch": prefetch,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
