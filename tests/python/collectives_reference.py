"""The reference for ProcessGroup's collectives: the same calls, with the same
inputs, in torch.distributed over gloo.

Run under torchrun (tests/support/collective_scenarios.h does):

    python -m torch.distributed.run --standalone --nproc-per-node W collectives_reference.py OUT_DIR

Each rank writes OUT_DIR/python_<W>_rank<R>.txt, one line per result, in the
text form tests/support/collective_scenarios.h writes for ddp's results, so
the test compares the two line for line. Every input is a small integer, or
a float with few bits, so every sum is exact whatever the order.
"""

import os
import re
import sys

import torch
import torch.distributed as dist


def values(t):
    codes = {torch.float32: "f32", torch.float64: "f64", torch.int64: "i64"}
    flat = t.detach().reshape(-1).tolist()
    if t.is_floating_point():
        text = " ".join(format(float(v), ".17g") for v in flat)
    else:
        text = " ".join(str(int(v)) for v in flat)
    shape = "x".join(str(s) for s in t.shape)
    return f"{codes[t.dtype]}[{shape}] {text}".rstrip()


def canon(v):
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "b:true" if v else "b:false"
    if isinstance(v, int):
        return f"i:{v}"
    if isinstance(v, float):
        return "f:" + format(v, ".17g")
    if isinstance(v, str):
        return "s:" + v
    if isinstance(v, torch.Tensor):
        return "t:" + values(v)
    if isinstance(v, list):
        return "[" + ",".join(canon(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + ",".join(canon(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}={canon(v[k])}" for k in sorted(v)) + "}"
    raise TypeError(f"no text form for {type(v)}")


def object_of_rank(r):
    # all_gather_object's values: a string, an int and a small dict in turn.
    if r % 3 == 0:
        return f"text from rank {r}"
    if r % 3 == 1:
        return 1000 + r
    return {"rank": r, "scale": 0.5 * r, "tag": "x"}


def missing_named(error):
    # "Rank 2 failed to pass monitoredBarrier" or "Ranks 1, 2 failed ...".
    m = re.search(r"Ranks? ([0-9, ]+) failed to pass monitoredBarrier", str(error))
    if not m:
        return "unparsed: " + str(error).splitlines()[0]
    return ",".join(str(r) for r in sorted(int(x) for x in m.group(1).replace(" ", "").split(",") if x))


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    w, r = dist.get_world_size(), dist.get_rank()
    lines = []

    def emit(name, text):
        lines.append(f"rank={r} {name}: {text}")

    # reduce: a sum of floats into the last rank, a max of ints into rank 1.
    t = torch.tensor([r + 1.0, 10.0 * (r + 1), 0.5 * (r + 1)])
    dist.reduce(t, dst=w - 1, op=dist.ReduceOp.SUM)
    if r == w - 1:
        emit("reduce_sum", values(t))
    t = torch.tensor([r, 100 - r, (7 * r) % 5], dtype=torch.int64)
    dist.reduce(t, dst=1, op=dist.ReduceOp.MAX)
    if r == 1:
        emit("reduce_max", values(t))

    # reduce_scatter_tensor: a sum of floats (each rank's part of 2), a max
    # of ints.
    inp = torch.tensor([(r + 1) * (k + 1) + 0.25 * k for k in range(2 * w)])
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, inp)
    emit("reduce_scatter_sum", values(out))
    inp = torch.tensor([(7 * r + 3 * k) % 11 for k in range(2 * w)], dtype=torch.int64)
    out = torch.empty(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.MAX)
    emit("reduce_scatter_max", values(out))

    # gather into rank 1.
    t = torch.tensor([[r, r + 1], [r * r, -r]], dtype=torch.int64)
    gathered = [torch.empty_like(t) for _ in range(w)] if r == 1 else None
    dist.gather(t, gather_list=gathered, dst=1)
    if r == 1:
        for i, g in enumerate(gathered):
            emit(f"gather[{i}]", values(g))

    # scatter from the last rank.
    out = torch.empty(3)
    sources = [torch.tensor([100.0 * i + 0.25, 100.0 * i + 1, -float(i)]) for i in range(w)] if r == w - 1 else None
    dist.scatter(out, scatter_list=sources, src=w - 1)
    emit("scatter", values(out))

    # all_to_all with uneven splits: rank r sends r + j + 1 rows to rank j.
    in_splits = [r + j + 1 for j in range(w)]
    out_splits = [j + r + 1 for j in range(w)]
    rows = []
    for j in range(w):
        for k in range(in_splits[j]):
            v = 1000.0 * r + 100.0 * j + k
            rows.append([v, -v])
    inp = torch.tensor(rows)
    out = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    emit("all_to_all_uneven", values(out))
    # and with even splits.
    inp = torch.arange(2 * w, dtype=torch.int64) + 10 * r
    out = torch.empty(2 * w, dtype=torch.int64)
    dist.all_to_all_single(out, inp)
    emit("all_to_all_even", values(out))

    # batch_isend_irecv: a ring, each rank sends to the next.
    send = torch.tensor([r, r * r, -r], dtype=torch.int64)
    recv = torch.empty(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, send, (r + 1) % w, tag=3), dist.P2POp(dist.irecv, recv, (r + w - 1) % w, tag=3)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    emit("batch_isend_irecv_ring", values(recv))

    # Object collectives.
    objects = [{"name": "adam", "step": 7, "lr": 0.25, "betas": [0.5, 0.75], "weights": torch.tensor([1.5, -2.0])}
               if r == w - 1 else None]
    dist.broadcast_object_list(objects, src=w - 1)
    emit("broadcast_object_dict", canon(objects[0]))
    objects = [f"hello from rank {r}" if r == 1 else None]
    dist.broadcast_object_list(objects, src=1)
    emit("broadcast_object_string", canon(objects[0]))
    gathered = [None] * w
    dist.all_gather_object(gathered, object_of_rank(r))
    emit("all_gather_object", canon(gathered))

    # monitored_barrier: everyone arrives.
    dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=30))
    emit("monitored_barrier_all", "ok")
    timeout = __import__("datetime").timedelta(seconds=2)
    # The last rank stays away (each case on a group of its own: a rank that
    # skipped one is a call behind on that group).
    group = dist.new_group(list(range(w)))
    if r != w - 1:
        try:
            dist.monitored_barrier(group, timeout=timeout)
            if r == 0:
                emit("monitored_barrier_last_missing", "passed")
        except RuntimeError as e:
            if r == 0:
                emit("monitored_barrier_last_missing", missing_named(e))
    dist.barrier()
    # Only rank 0 comes, naming every missing rank, then only the first.
    for wait_all in (True, False):
        group = dist.new_group(list(range(w)))
        if r == 0:
            try:
                dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=wait_all)
                emit(f"monitored_barrier_alone_wait_all={int(wait_all)}", "passed")
            except RuntimeError as e:
                emit(f"monitored_barrier_alone_wait_all={int(wait_all)}", missing_named(e))
        dist.barrier()

    with open(os.path.join(out_dir, f"python_{w}_rank{r}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.barrier()
    # Not destroy_process_group: the monitored barriers' groups hold
    # unfinished receives on the ranks that stayed away.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
