"""Two ranks on one host, started with torch.multiprocessing (spawn) and gloo.

Run by test_ranks_dist.py in a child interpreter with a timeout:
``python ranks_worker.py OUT_DIR CHECKPOINT``. Each rank writes
``OUT_DIR/rank<N>.json``; ``OUT_DIR/skip`` says why the environment cannot run
it (no gloo, no spawn).
"""

from __future__ import annotations

import json
import os
import sys

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


def smaps_of(path: str) -> dict[str, int]:
    """Rss and Pss (bytes) of this process's mappings of ``path``, from /proc/self/smaps."""
    real = os.path.realpath(path)
    totals = {"Rss": 0, "Pss": 0}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                inside = len(head) >= 6 and head[5] == real
            elif inside and head and head[0].rstrip(":") in totals:
                totals[head[0].rstrip(":")] += int(head[1]) * 1024
    return totals


def file_offset(ptr: int) -> tuple[str, int] | None:
    """(file, offset in it) of the mapping holding ``ptr``, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return (parts[5] if len(parts) >= 6 else "", int(parts[2], 16) + ptr - lo)
    return None


def rank_main(rank: int, out: str, ckpt: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, TESTS)
    from models import PLAN, Pair

    from mapoffload import (
        GIB_BYTES,
        MappedRegions,
        empty_weights,
        host_copies_would_not_fit,
        load_checkpoint,
        local_world,
        shard_tensor,
    )

    open(os.path.join(out, f"started{rank}"), "w").close()
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    result: dict = {"rank": rank}
    # The local world without torchrun: torch.distributed's world size.
    result["world_from_dist"] = [local_world().size, local_world().source]
    os.environ["LOCAL_WORLD_SIZE"] = str(WORLD)
    result["world_from_env"] = [local_world().size, local_world().source]
    gib = GIB_BYTES
    # 3 GiB each on a host with 10 GiB: one copy fits, two (plus two reserves) do not.
    result["gate"] = [
        host_copies_would_not_fit(3 * gib, available_bytes=10 * gib, local_ranks=1),
        host_copies_would_not_fit(3 * gib, available_bytes=10 * gib),
    ]

    # The whole checkpoint, mapped, every page read: the two ranks share them.
    with empty_weights():
        full = Pair(64, 4096)
    load_checkpoint(full, ckpt, keep_mapping=True)
    total = sum(float(p.double().sum()) for p in full.parameters())
    result["checksum"] = total
    dist.barrier()
    result["smaps"] = smaps_of(ckpt)
    dist.barrier()  # both measured while both hold the pages

    # Tensor parallel: rank and world size come from the process group.
    with empty_weights():
        model = Pair(64, 4096, tp=WORLD)
    report = load_checkpoint(model, ckpt, keep_mapping=True, shard_plan=PLAN)
    regions = MappedRegions()
    whole = file_offset(full.up.weight.data_ptr())
    mine = file_offset(model.up.weight.data_ptr())
    half = model.up.weight.nbytes
    # A view of a mapping of the checkpoint, at this rank's rows in the file.
    result["row_slice_view"] = [regions.holds(model.up.weight), mine[0] == os.path.realpath(ckpt),
                                mine[1] == whole[1] + rank * half,
                                shard_tensor(full.up.weight, rank, WORLD, 0).data_ptr()
                                == full.up.weight.data_ptr() + rank * half]
    result["column_slice_held"] = regions.holds(model.down.weight)
    result["report"] = [report.shard, report.bytes_sliced_mapped, report.bytes_sliced_copied,
                        report.copied]
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    with torch.no_grad():
        y = model(x)
        dist.all_reduce(y)
        want = full(x)
    result["max_diff"] = float((y - want).abs().max())
    result["scale"] = float(want.abs().max())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    out, ckpt = sys.argv[1], sys.argv[2]
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        with open(os.path.join(out, "skip"), "w") as f:
            f.write("torch.distributed with gloo is not available")
        return
    try:
        mp.spawn(rank_main, args=(out, ckpt), nprocs=WORLD, join=True)
    except Exception as exc:
        if not any(os.path.exists(os.path.join(out, f"started{r}")) for r in range(WORLD)):
            with open(os.path.join(out, "skip"), "w") as f:
                f.write(f"cannot spawn ranks: {exc}")
            return
        raise


if __name__ == "__main__":
    main()
