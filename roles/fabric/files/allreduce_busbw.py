# SPDX-License-Identifier: MIT
"""All-reduce bus bandwidth across the Sparks through NCCL, measured as nccl-tests' all_reduce_perf does.

Runs in the engine image on every node at once (roles/fabric/tasks/nccl.yml), one process per node on its
GPU, with the rank's NCCL environment (NCCL_IB_HCA naming every rail, NCCL_IB_GID_INDEX, ...). Rank 0 prints
one JSON line per message size; the last one (largest size) is what the fabric check compares with
glm53_fabric_min_busbw_gbps. algbw = bytes / time; busbw = algbw * 2(n-1)/n, nccl-tests' definition for
all-reduce, so the numbers compare with published all_reduce_perf results.
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="the head's fabric IP")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sizes-mib", default="64,256,1024", help="message sizes, MiB, comma-separated")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=300), device_id=torch.device("cuda", 0))
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        size = mib * 2**20
        data = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        for _warmup in range(args.warmup):
            dist.all_reduce(data)
        # A wrong sum means the fabric corrupted data: fail rather than report a bandwidth.
        data.fill_(1.0)
        dist.all_reduce(data)
        if not torch.all(data == float(args.world)):
            raise SystemExit(f"all-reduce of {mib} MiB returned a wrong sum on rank {args.rank}")
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _iteration in range(args.iters):
            dist.all_reduce(data)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.iters
        algbw = size / seconds
        busbw = algbw * 2 * (args.world - 1) / args.world
        if args.rank == 0:
            print(json.dumps({"size_bytes": size, "time_us": round(seconds * 1e6, 1),
                              "algbw_gbps": round(algbw * 8 / 1e9, 2), "busbw_gbps": round(busbw * 8 / 1e9, 2)}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
