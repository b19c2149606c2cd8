"""What hashing the weights for the model identity costs at load time, side by side in one run.

    PYTHONPATH=/tmp/site:. python3 experiments/h200_identity_cost.py --size-gb 12 --out $OUT          # H200
    .venv/bin/python experiments/h200_identity_cost.py --preset small --device cpu --out docs/results  # a preset

Writes a safetensors checkpoint (a generated Llama shape of about --size-gb, in shards of --shard-gb, or a
`make-model` preset) into --work-dir, then times reading it onto --device in --dtype, the arms alternated, --repeats
times each:
- main: safetensors opened on the device, no hashing (the loader before the identity covered bytes);
- host: read on the host then moved, no hashing (the new read path without its hash);
- hashed: the same with every tensor hashed on background threads (what `kvshare serve` does now; the digest is
  the tensors' identity, so it is checked equal across repeats);
- files hot / files cold: kvshare.identity.checkpoint_digest of the weight files, as the vLLM connector computes it
  at start, from the page cache and after dropping this checkpoint's pages (posix_fadvise DONTNEED).
Also checks the claim behind the dummy identity: torch's CPU and CUDA generators draw other numbers for one seed.
Prints a table (wall-clock median and minimum, and the process's CPU time, all threads: the work an arm adds even
where other processes share the cores); writes identity_cost.json under --out. The checkpoint is deleted afterwards
unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvshare.engine.make_model import Preset, hf_config, make_model
from kvshare.engine.model import CausalLM
from kvshare.engine.weights import dummy_tensor, read_safetensors, shard_files
from kvshare.hf.config import ModelConfig, default_dtype
from kvshare.identity import TensorDigests, files_digest, weight_files

# A Llama-3-8B-like layer (hidden 4096, MLP 14336, 32 q / 8 kv heads of 128): 436 MB a layer in bf16.
LAYER_SHAPE = dict(architecture="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_heads=32,
                   num_kv_heads=8, head_dim=128, vocab_size=32000, max_position=8192, rope_theta=5e5,
                   tokenizer_vocab=0, weights_dtype="bfloat16")


@dataclass(frozen=True)
class Arm:
    name: str
    seconds: list[float]  # wall clock per run
    cpu_seconds: list[float]  # CPU time of the whole process (every thread) per run: the work, whatever else runs
    gbytes: float

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu_seconds)


def generated_preset(size_gb: float) -> Preset:
    """The layer shape above with as many layers as make about size_gb (bf16, embeddings and head included)."""
    with torch.device("meta"):
        one = CausalLM(ModelConfig.from_hf(hf_config(Preset(num_layers=1, **LAYER_SHAPE), 0, 1)))
        two = CausalLM(ModelConfig.from_hf(hf_config(Preset(num_layers=2, **LAYER_SHAPE), 0, 1)))
    size = lambda model: sum(p.numel() * 2 for p in model.parameters())  # noqa: E731 - bf16 bytes
    per_layer = size(two) - size(one)
    return Preset(num_layers=max(1, round((size_gb * 1e9 - size(one) + per_layer) / per_layer)), **LAYER_SHAPE)


def write_checkpoint(folder: Path, preset: Preset, device: str, shard_gb: float) -> None:
    """config.json and shards of about shard_gb, tensors drawn on `device` (fast on a GPU) and saved from the host."""
    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(preset, 0, 1)
    (folder / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(ModelConfig.from_hf(config)).named_parameters()}
    shards, shard, shard_bytes = [], {}, 0
    for name, shape in shapes.items():
        shard[name] = dummy_tensor(name, shape, 0, torch.device(device), torch.bfloat16).cpu()
        shard_bytes += shard[name].nbytes
        if shard_bytes >= shard_gb * 1e9:
            shards.append(shard)
            shard, shard_bytes = {}, 0
    shards += [shard] if shard else []
    for i, part in enumerate(shards):
        save_file(part, str(folder / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        shards[i] = None  # free the host copy once written


def read_main(folder: Path, names: set[str], device: torch.device, dtype: torch.dtype) -> dict:
    """The read loop as it was before hashing: safetensors opened on the device itself."""
    state = {}
    for path in shard_files(folder):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name in names:
                    state[name] = f.get_tensor(name).to(dtype)
    return state


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the host clock is read only after the copies finished


def drop_page_cache(folder: Path) -> None:
    os.sync()  # DONTNEED drops clean pages only
    for path in shard_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(folder: Path, device: torch.device, dtype: torch.dtype, repeats: int) -> tuple[list[Arm], str]:
    config = ModelConfig.from_dir(folder)
    with torch.device("meta"):
        names = {name for name, _ in CausalLM(config).named_parameters()}
    gbytes = sum(p.stat().st_size for p in shard_files(folder)) / 1e9
    names_of_arms = ("main", "host", "hashed", "files hot", "files cold")
    times: dict[str, list[float]] = {name: [] for name in names_of_arms}
    cpu: dict[str, list[float]] = {name: [] for name in names_of_arms}
    digests_seen = set()

    def hashed():
        with TensorDigests() as digests:
            state = read_safetensors(folder, names, device, dtype, digests)
            digests_seen.add(digests.hexdigest())  # inside the timed arm: load_model waits for it too
        return state

    arms = {"main": lambda: read_main(folder, names, device, dtype),
            "host": lambda: read_safetensors(folder, names, device, dtype), "hashed": hashed}
    read_safetensors(folder, names, device, dtype)  # warm-up: page cache, allocator, CUDA context
    for _ in range(repeats):
        for name, arm in arms.items():  # alternated, so drift hits every arm alike
            started, cpu_started = time.perf_counter(), time.process_time()
            state = arm()
            synchronize(device)
            times[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
            del state
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for name in ("files hot", "files cold"):
            if name == "files cold":
                drop_page_cache(folder)
            started, cpu_started = time.perf_counter(), time.process_time()
            digest = files_digest(weight_files(folder))  # checkpoint_digest without its per-process cache
            times[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    assert len(digests_seen) == 1, "the tensors' digest changed between repeats"
    return [Arm(name, times[name], cpu[name], gbytes) for name in names_of_arms], digest


def generators_differ() -> bool | None:
    """True if CPU and CUDA generators seeded alike draw other numbers (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    cpu = dummy_tensor("w", torch.Size([4096]), 0, torch.device("cpu"), torch.float32)
    cuda = dummy_tensor("w", torch.Size([4096]), 0, torch.device("cuda"), torch.float32).cpu()
    return not torch.equal(cpu, cuda)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=12.0, help="generated checkpoint size (default 12)")
    parser.add_argument("--preset", default=None, help="a make-model preset instead of a generated shape")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="shard size (default 4)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: kvshare serve's for the device")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each arm (default 3)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/identity_cost")))
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or default_dtype(args.device))
    work = Path(tempfile.mkdtemp(prefix="kvshare-identity-", dir=args.work_dir))
    try:
        started = time.perf_counter()
        if args.preset:
            folder, shape = make_model(args.preset, work / args.preset), args.preset
        else:
            preset = generated_preset(args.size_gb)
            folder, shape = work / "generated", f"llama hidden 4096 x {preset.num_layers} layers"
            write_checkpoint(folder, preset, args.device, args.shard_gb)
        written_s = time.perf_counter() - started
        shards = len(shard_files(folder))
        arms, digest = measure(folder, device, dtype, args.repeats)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    base = arms[0].median
    print(f"{shape}: {arms[0].gbytes:.2f} GB in {shards} shard(s), written in {written_s:.1f} s; device {device}, "
          f"dtype {dtype}; median of {args.repeats}")
    print(f"{'arm':<12} {'median s':>9} {'GB/s':>7} {'vs main':>8} {'min s':>7} {'CPU s':>7}  runs (s)")
    for arm in arms:
        print(f"{arm.name:<12} {arm.median:9.3f} {arm.gbytes / arm.median:7.2f} {arm.median / base - 1:+8.1%} "
              f"{min(arm.seconds):7.3f} {arm.cpu_median:7.3f}  " + " ".join(f"{s:.3f}" for s in arm.seconds))
    differ = generators_differ()
    print(f"CPU and CUDA generators, one seed: {'differ' if differ else 'equal' if differ is False else 'no CUDA'}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = dict(shape=shape, gbytes=arms[0].gbytes, shards=shards, device=str(device), dtype=str(dtype),
                  repeats=args.repeats, torch=torch.__version__, cpu_count=os.cpu_count(), files_digest=digest,
                  cpu_cuda_generators_differ=differ,
                  arms=[dict(asdict(arm), median=arm.median, cpu_median=arm.cpu_median) for arm in arms])
    (args.out / "identity_cost.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
