"""Subprocess side of the conformance tests (run as a script; prints or writes JSON).

    python _sglang_probe.py parse-args ROOT ARGV_JSON      SGLang's server-argument parser on each argv
    python _sglang_probe.py engine ROOT PLAN INIT RANK WORLD OUT    one engine TP rank, SGLang's code
    python _sglang_probe.py trainer PLAN INIT WORLD OUT SEED        rank 0, hpcrl's code
    python _sglang_probe.py join-args ROOT KWARGS_JSON     what SGLang's init_custom_process_group
                                                           asks torch for (recorded, nothing joins)
    python _sglang_probe.py mem-fraction ROOT CASES_JSON   SGLang's mem_fraction_static heuristic per case

PLAN is a JSON list of buckets, each a list of [name, dtype, shape]. The trainer (hpcrl's
`init_custom_process_group`, `flatten_bucket`) fills the tensors from SEED and broadcasts every
bucket from rank 0; an engine rank joins with SGLang's `init_custom_process_group` (utils/common.py)
and receives each bucket the way SGLang's weight updater does (`FlattenedTensorBucket.empty`,
broadcast src=0, `reconstruct_tensors`). Both write {name: sha256 of the tensor's bytes} to OUT.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
from pathlib import Path

GROUP = "weight_update_group"
TIMEOUT_S = 120


def _digest(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def parse_args(root: str, argv_file: str) -> None:
    """Prints {"options": {option string: dest} of SGLang's parser, "results": per argv of the JSON list
    in `argv_file`, the parsed namespace (JSON-able values) or {"error": message}}. An argv with
    `--config FILE` is first merged with the file as prepare_server_args does (ConfigArgumentMerger)."""
    import argparse

    sys.path.insert(0, str(Path(__file__).parent))
    from _sglang_import import install

    install(Path(root))
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    results = []
    for argv in json.loads(Path(argv_file).read_text()):
        try:
            if "--config" in argv:  # server_args.prepare_server_args, before it parses
                from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

                argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
            args = parser.parse_args(argv)
        except (argparse.ArgumentError, SystemExit, ValueError) as exc:
            results.append({"error": str(exc)})
            continue
        results.append({k: v for k, v in vars(args).items()
                        if v is None or isinstance(v, (str, int, float, bool, list))})
    options = {o: a.dest for a in parser._actions for o in a.option_strings}
    print(json.dumps({"options": options, "results": results}))


def engine(root: str, plan_file: str, init: str, rank: int, world: int, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from _sglang_import import install

    install(Path(root))
    import torch

    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    group = init_custom_process_group(backend="gloo", init_method=init, world_size=world, rank=rank,
                                      group_name=GROUP, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    digests = {}
    for bucket in json.loads(Path(plan_file).read_text()):
        names, dtypes, shapes = zip(*bucket)
        recv = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        torch.distributed.broadcast(recv.get_flattened_tensor(), src=0, group=group)
        digests.update({name: _digest(t) for name, t in recv.reconstruct_tensors()})
    Path(out).write_text(json.dumps({"torch": torch.__version__, "digests": digests}))
    _leave(group)


def trainer(plan_file: str, init: str, world: int, out: str, seed: int) -> None:
    import torch
    import torch.distributed as dist

    from hpcrl.dist import joined_store
    from hpcrl.rollout.weight_sender import flatten_bucket, init_custom_process_group, parse_dtype

    # the test process hosts the store (tests/stores.py): no port to race for
    group = init_custom_process_group("gloo", init, world, 0, GROUP, timeout_s=TIMEOUT_S,
                                      store=joined_store(init, world, TIMEOUT_S))
    gen = torch.Generator().manual_seed(seed)
    digests = {}
    for bucket in json.loads(Path(plan_file).read_text()):
        tensors = []
        for name, dtype, shape in bucket:
            t = torch.randn(shape, generator=gen).to(parse_dtype(dtype))
            digests[name] = _digest(t)
            tensors.append(t)
        dist.broadcast(flatten_bucket(tensors), src=0, group=group)
    Path(out).write_text(json.dumps({"torch": torch.__version__, "digests": digests}))
    _leave(group)


def record_join(join, **kwargs) -> dict:
    """The arguments `join(**kwargs)` (an init_custom_process_group) passes to torch's private
    `_new_process_group_helper`, with the rendezvous and the helper replaced by recorders: nothing
    connects, so an NCCL group can be asked for on a CPU machine. Keys: what the helper got
    (device_id, backend as a string, group_name, world_size, rank)."""
    import torch.distributed.distributed_c10d as c10d

    seen: dict = {}

    class Store:
        def set_timeout(self, timeout) -> None:
            pass

    def rendezvous(init_method, rank, world_size, timeout=None):
        yield Store(), rank, world_size

    def helper(world_size, rank, ranks, backend, store, group_name=None, timeout=None, device_id=None,
               **options):
        seen.update(world_size=world_size, rank=rank, backend=str(backend), group_name=group_name,
                    device_id=None if device_id is None else str(device_id))
        return object(), None

    saved = c10d.rendezvous, c10d._new_process_group_helper, c10d.PrefixStore
    c10d.rendezvous, c10d._new_process_group_helper = rendezvous, helper
    c10d.PrefixStore = lambda prefix, store: store
    try:
        join(**kwargs)
    finally:
        c10d.rendezvous, c10d._new_process_group_helper, c10d.PrefixStore = saved
    return seen


def join_args(root: str, kwargs_json: str) -> None:
    """Prints record_join of SGLang's own init_custom_process_group (utils/common.py) called with the
    keyword arguments in `kwargs_json`."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _sglang_import import install

    install(Path(root))
    from sglang.srt.utils.common import init_custom_process_group

    print(json.dumps(record_join(init_custom_process_group, **json.loads(kwargs_json))))


def mem_fraction(root: str, cases_file: str) -> None:
    """Prints, per case {"argv", "gpu_mib", "mla"} of the JSON list in `cases_file`, the
    mem_fraction_static SGLang's own `handle_gpu_memory_settings` (arg_groups/memory_hook.py) sets,
    after the parts of its `handle_cuda_graph_config` that read these flags (`parse_cuda_graph_config`,
    `apply_deepep_adjustments`), as on a CUDA GPU of `gpu_mib` MiB: the device capacity, the model's
    MLA-ness and CUDA's default prefill graph backend (breakable; cuda_graph_config.py
    `default_prefill_backend`) are what this machine cannot give; the rest is SGLang's code on
    SGLang's parsed arguments. Left out: `apply_cuda_graph_compatibility`, whose rules turn prefill
    graphs off for what hpcrl's engines never are (KDA, DeepSeek-V4, context or pipeline parallel)
    and which imports SGLang's model registry."""
    import argparse
    import types

    sys.path.insert(0, str(Path(__file__).parent))
    from _sglang_import import install

    install(Path(root))
    import sglang.srt.arg_groups.cuda_graph_hook as graph_hook
    import sglang.srt.arg_groups.memory_hook as memory_hook
    import sglang.srt.model_executor.cuda_graph_config as graph_config
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    graph_config.default_prefill_backend = lambda: graph_config.Backend.BREAKABLE
    results = []
    for case in json.loads(Path(cases_file).read_text()):
        model = types.SimpleNamespace(is_multimodal=False,
                                      hf_config=types.SimpleNamespace(architectures=["X"]))
        for name, module in list(sys.modules.items()):
            if name.startswith("sglang.srt.arg_groups"):
                if hasattr(module, "model_config_of"):
                    module.model_config_of = lambda _args, model=model: model
                if hasattr(module, "use_mla_backend"):
                    module.use_mla_backend = lambda _args, mla=case["mla"]: mla
                if hasattr(module, "get_device_memory_capacity"):
                    module.get_device_memory_capacity = lambda _device=None, mib=case["gpu_mib"]: mib
        argv = ["--model-path", "unused", "--device", "cuda", *case["argv"]]
        server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
        server_args._raw_input, server_args._resolved_overrides = {}, []  # as the resolution pipeline starts
        server_args._input_frozen = True
        graph_hook.parse_cuda_graph_config(server_args)
        graph_hook.apply_deepep_adjustments(server_args)
        memory_hook.handle_gpu_memory_settings(server_args)
        results.append(resolving_view(server_args).mem_fraction_static)
    print(json.dumps(results))


def _leave(group) -> None:
    """Wait for every rank, then exit without interpreter teardown: the trainer hosts the group's
    TCPStore, and a store or gloo thread torn down while a peer still talks to it aborts the process
    ("terminate called without an active exception", exit -6; seen once in CI after every bucket
    had arrived)."""
    import os

    import torch.distributed as dist

    dist.barrier(group=group)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "parse-args":
        parse_args(rest[0], rest[1])
    elif cmd == "engine":
        engine(rest[0], rest[1], rest[2], int(rest[3]), int(rest[4]), rest[5])
    elif cmd == "trainer":
        trainer(rest[0], rest[1], int(rest[2]), rest[3], int(rest[4]))
    elif cmd == "join-args":
        join_args(rest[0], rest[1])
    elif cmd == "mem-fraction":
        mem_fraction(rest[0], rest[1])
    else:
        raise SystemExit(f"unknown command {cmd!r}")
