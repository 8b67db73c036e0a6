"""One engine step of a random-weight Llama against the memory roofline, on CPU or CUDA.

Models (`--shape`): `100m`, throughput.py's shape (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 32000); `1b`, TinyLlama-1.1B's (hidden 2048, 22 layers, 32 heads, 4 KV
heads, intermediate 5632); `mixtral-100m`, the 100m shape with Mixtral's MoE (8 experts of
intermediate 1024, top 2: ~100M parameters active per token, ~270M in all); `deepseek-100m`,
the 100m shape with DeepSeek-V2's MLA (latent 256 + rope 32) and MoE (layer 0 dense, then 8
routed experts of 512, top 2, and one shared: ~90M active, ~180M in all). The checkpoint is
written here with safetensors alone, so the script runs where only torch (and Triton, on CUDA)
is installed.

Prints the read bandwidth (a sum over 1 GiB on the device at the engine's thread count, bytes
read per second), the read bound of a decode step (the bytes it must read / bandwidth: every
weight of a dense model; of a MoE, the weights outside the experts plus the experts the batch's
tokens are routed to, counted in each step, plus the K/V of the batch's contexts), and the measured
ModelRunner.execute time of decode batches (context 600 tokens each) and of a 512-token
prefill, median of repeated runs, for each forward mode asked for (the compiled forward,
engine.compilation, and the eager one; measurements of the modes alternate).

    python benchmarks/step_time.py [--threads 2] [--batches 1,4,32] [--repeats 10]
                                   [--modes compiled,eager] [--device cpu|cuda]
                                   [--shape 100m|1b] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from pdcluster.engine.config import EngineConfig  # noqa: E402
from pdcluster.engine.runner import ModelRunner, SequenceChunk  # noqa: E402
from pdcluster.engine.parallel import LinearBase  # noqa: E402

CONTEXT = 600
BLOCKS_PER_SEQ = 40
SHAPES = {
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "mixtral-100m": dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                         num_local_experts=8, num_experts_per_tok=2),
    "deepseek-100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                          num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                          kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64,
                          v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
                          n_shared_experts=1, moe_intermediate_size=512,
                          first_k_dense_replace=1, topk_method="greedy"),
}


def write_random_llama(path: Path, shape: dict, dtype: torch.dtype, seed: int = 0) -> None:
    """A Llama checkpoint (config.json + model.safetensors, tied embeddings) with normal(0,
    0.02) weights and unit norms, in `dtype`; a Mixtral one where `shape` has
    `num_local_experts`, a DeepSeek-V2 one where it has `kv_lora_rank`."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads = shape["num_attention_heads"]
    head_dim = hidden // heads
    kv = shape["num_key_value_heads"] * head_dim

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * 0.02).to(dtype)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=dtype)

    def swiglu(prefix: str, size: int, names=("gate_proj", "up_proj", "down_proj")) -> dict:
        gate, up, down = names
        return {f"{prefix}{gate}.weight": normal(size, hidden),
                f"{prefix}{up}.weight": normal(size, hidden),
                f"{prefix}{down}.weight": normal(hidden, size)}

    tensors = {"model.embed_tokens.weight": normal(shape["vocab_size"], hidden),
               "model.norm.weight": ones(hidden)}
    mla = shape.get("kv_lora_rank", 0)
    for i in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors |= {prefix + "input_layernorm.weight": ones(hidden),
                    prefix + "post_attention_layernorm.weight": ones(hidden)}
        attn = prefix + "self_attn."
        if mla:
            nope, rope, v = (shape["qk_nope_head_dim"], shape["qk_rope_head_dim"],
                             shape["v_head_dim"])
            tensors |= {attn + "q_proj.weight": normal(heads * (nope + rope), hidden),
                        attn + "kv_a_proj_with_mqa.weight": normal(mla + rope, hidden),
                        attn + "kv_a_layernorm.weight": ones(mla),
                        attn + "kv_b_proj.weight": normal(heads * (nope + v), mla),
                        attn + "o_proj.weight": normal(hidden, heads * v)}
        else:
            tensors |= {attn + "q_proj.weight": normal(hidden, hidden),
                        attn + "k_proj.weight": normal(kv, hidden),
                        attn + "v_proj.weight": normal(kv, hidden),
                        attn + "o_proj.weight": normal(hidden, hidden)}
        if shape.get("num_local_experts"):
            moe = prefix + "block_sparse_moe."
            tensors[moe + "gate.weight"] = normal(shape["num_local_experts"], hidden)
            for e in range(shape["num_local_experts"]):
                tensors |= swiglu(f"{moe}experts.{e}.", inter, ("w1", "w3", "w2"))
        elif mla and i >= shape["first_k_dense_replace"]:
            moe, size = prefix + "mlp.", shape["moe_intermediate_size"]
            tensors[moe + "gate.weight"] = normal(shape["n_routed_experts"], hidden)
            for e in range(shape["n_routed_experts"]):
                tensors |= swiglu(f"{moe}experts.{e}.", size)
            tensors |= swiglu(moe + "shared_experts.", size * shape["n_shared_experts"])
        else:
            tensors |= swiglu(prefix + "mlp.", inter)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    arch, model_type = (("MixtralForCausalLM", "mixtral") if shape.get("num_local_experts")
                        else ("DeepseekV2ForCausalLM", "deepseek_v2") if mla
                        else ("LlamaForCausalLM", "llama"))
    extra = {"head_dim": shape["qk_rope_head_dim"], "q_lora_rank": None} if mla else {}
    (path / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": model_type, **shape, **extra,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch.")}))


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in ms, after one warm-up call; on CUDA each call is
    synchronized."""
    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def read_bandwidth(device: torch.device = torch.device("cpu"), nbytes: int = 1 << 30,
                   repeats: int = 5) -> float:
    """Bytes per second of a float32 sum over `nbytes` on `device`."""
    x = torch.ones(nbytes // 4, device=device)
    return nbytes / (median_ms(x.sum, repeats, device) / 1000)


def drop_skinny_weights(model: torch.nn.Module) -> None:
    """Take the skinny GEMM's weight copies out of an eager model, so every linear runs
    oneDNN's matmul: the comparison the "eager-onednn" mode measures."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.skinny_weight = None
    model.logits_skinny = None


def measure(threads: int, batches: list[int], repeats: int,
            modes: tuple[str, ...] = ("eager",), device: str = "cpu", shape: str = "100m",
            dtype: str = "float32", profile_batch: int = 0) -> dict:
    """Read bandwidth (bytes/s), weight bytes, the weight-read bound (ms), and per forward
    mode ("compiled" | "eager" | "eager-forward": eager without the C++ decode stack |
    "eager-onednn": eager-forward without the skinny GEMM | "eager-cross-layer": eager on a
    cross-layer KV cache, engine.kv_cache) the median
    execute time (ms) of each decode batch and of a 512-token prefill, at `threads`, of the
    `shape` model on `device` in `dtype`; with `profile_batch`, each mode's profiler table of
    decode steps at that batch. Raises RuntimeError if a compiled runner fell back to eager."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    bandwidth = read_bandwidth(dev)
    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "random-llama"
        write_random_llama(model_dir, SHAPES[shape], getattr(torch, dtype))
        for mode in modes:
            started = time.perf_counter()
            runners[mode] = ModelRunner(EngineConfig(
                model=str(model_dir), num_kv_blocks=2664, torch_threads=threads,
                device=device, dtype=dtype, enforce_eager=mode != "compiled",
                kv_cache_layout="cross-layer" if mode == "eager-cross-layer" else "auto"))
            if mode == "eager-onednn":
                drop_skinny_weights(runners[mode].model)
                runners[mode].cpu_decode_stack = None
            elif mode == "eager-forward":
                runners[mode].cpu_decode_stack = None
            elif mode == "eager-cross-layer":
                assert runners[mode].kv_cache.layout == "cross-layer"
            elif runners[mode].forward_mode != mode:
                raise RuntimeError(f"asked for a {mode} forward, got {runners[mode].forward_mode}")
            # every block holds data, as a served context does: a block never written is the
            # kernel's shared zero page on the host cache (engine.kv_cache.host_zeros), whose
            # reads hit the CPU's caches and would understate what reading K/V costs
            for tensor in runners[mode].kv_cache.k + runners[mode].kv_cache.v:
                tensor.normal_()
            graphs = runners[mode].decode_graphs
            print(f"{mode} runner ready in {time.perf_counter() - started:.1f} s"
                  + (f" (CUDA graphs of decode batches up to {graphs.sizes[-1]})" if graphs else ""))
    first = runners[modes[0]]
    # packed CPU weights are opaque: count the bytes of their shape
    weight_bytes = sum(p.numel() * p.element_size() for p in first.model.parameters())
    decode: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    step_bytes: dict[int, int] = {}
    for batch in batches:
        chunks = decode_chunks(batch)
        step_bytes[batch] = bytes_read(first, chunks)
        for mode, runner in runners.items():
            decode[mode][batch] = median_ms(lambda: runner.execute(chunks), repeats, dev)
    prompt = [SequenceChunk(list(range(3, 515)), 0, list(range(2000, 2032)))]
    prefill = {mode: median_ms(lambda: runner.execute(prompt), 5, dev)
               for mode, runner in runners.items()}
    profiles = {}
    if profile_batch:
        chunks = decode_chunks(profile_batch)
        profiles = {mode: profile_steps(lambda: runner.execute(chunks), dev)
                    for mode, runner in runners.items()}
        for mode, runner in runners.items():
            if runner.decode_graphs is not None:
                profiles[mode] += "\n" + graph_step_phases(runner, chunks, repeats)
    return {"bandwidth": bandwidth, "weight_bytes": weight_bytes,
            "bound_ms": weight_bytes / bandwidth * 1000, "decode_ms": decode,
            "step_bytes": step_bytes,
            "step_bound_ms": {b: n / bandwidth * 1000 for b, n in step_bytes.items()},
            "prefill_ms": prefill, "profiles": profiles}


def bytes_read(runner: ModelRunner, chunks: list[SequenceChunk]) -> int:
    """The bytes one decode step of `chunks` must read: every weight outside the experts,
    the weights of each MoE layer's experts the step's tokens are routed to (counted in one
    step, through the layer's routing), and the K/V of every row's context."""
    from pdcluster.engine.models.fused_moe import FusedMoE

    model, cache = runner.model, runner.kv_cache
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    dense = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(
        p.numel() * p.element_size() for m in experts for p in m.parameters())
    routed: list[int] = []

    def count(module, args, _output) -> None:
        per_expert = sum(p[0].numel() * p.element_size() for p in module.parameters())
        routed.append(len(set(args[2].flatten().tolist())) * per_expert)

    hooks = [m.register_forward_hook(count) for m in experts]
    # hooks fire in the eager forward only: not inside a compiled graph or a graph replay
    compiled = runner.forward, runner.decode_graphs
    runner.forward, runner.decode_graphs = runner.model, None
    try:
        runner.execute(chunks)
    finally:
        runner.forward, runner.decode_graphs = compiled
        for hook in hooks:
            hook.remove()
    assert len(routed) == len(experts), "every MoE layer's routing is counted"
    per_token = cache.block_nbytes // cache.block_size
    kv = sum(c.num_computed_tokens + len(c.token_ids) for c in chunks) * per_token
    return dense + sum(routed) + kv


def decode_chunks(batch: int) -> list[SequenceChunk]:
    """`batch` decode rows, one new token each after CONTEXT cached tokens."""
    return [SequenceChunk([5], CONTEXT, list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)))
            for i in range(batch)]


def profile_steps(fn, device: torch.device, steps: int = 5) -> str:
    """torch.profiler's table of `steps` calls of fn (after one warm-up), top 25 operators by
    self CPU time: where a step's host time goes; on CUDA also by self device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    if device.type == "cuda":
        table += "\n" + averages.table(sort_by="self_device_time_total", row_limit=25)
    return table


def graph_step_phases(runner: ModelRunner, chunks: list[SequenceChunk], repeats: int) -> str:
    """Median ms of the parts of a decode step replayed from a CUDA graph, each synchronized:
    the host's input preparation with its copies, the replay alone, and the whole execute."""
    graphs, dev = runner.decode_graphs, runner.device
    size = graphs.size_for(len(chunks))
    prepare = median_ms(lambda: runner._inputs.prepare(chunks, pad_to=size), repeats, dev)
    replay = median_ms(lambda: graphs.replay(size), repeats, dev)
    step = median_ms(lambda: runner.execute(chunks), repeats, dev)
    return (f"graph step of {len(chunks)} rows (size {size}): prepare {prepare:.3f} ms, "
            f"replay {replay:.3f} ms, execute {step:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,4,32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--modes", default="compiled,eager",
                        help="forward modes to measure, alternating: compiled, eager, "
                             "eager-forward (eager, decode steps on the module forward, not "
                             "the C++ decode stack), eager-onednn (eager-forward with every "
                             "linear on oneDNN), eager-cross-layer (eager on a cross-layer "
                             "KV cache)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="100m", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--profile-batch", type=int, default=0,
                        help="also print torch.profiler's table of decode steps at this batch")
    args = parser.parse_args()
    modes = tuple(args.modes.split(","))
    result = measure(args.threads, [int(b) for b in args.batches.split(",")], args.repeats,
                     modes, args.device, args.shape, args.dtype, args.profile_batch)
    for mode, table in result["profiles"].items():
        print(f"== {mode}: decode batch {args.profile_batch}, 5 steps\n{table}")
    bound = result["bound_ms"]
    print(f"{args.shape} model, {args.dtype}, on {args.device}")
    print(f"read bandwidth {result['bandwidth'] / 1e9:.1f} GB/s ({args.threads} threads); "
          f"weights {result['weight_bytes'] / 1e6:.0f} MB -> decode step bound {bound:.1f} ms")
    for batch, nbytes in result["step_bytes"].items():
        print(f"decode batch {batch:3d} must read {nbytes / 1e6:.0f} MB (weights it uses + K/V) "
              f"-> bound {result['step_bound_ms'][batch]:.1f} ms")
    for mode in modes:
        for batch, ms in result["decode_ms"][mode].items():
            print(f"{mode:12s} decode batch {batch:3d}: {ms:7.1f} ms  ({ms / bound:.2f}x the "
                  f"weight bound, {ms / result['step_bound_ms'][batch]:.2f}x the step's)")
        print(f"{mode:12s} prefill 512 tokens: {result['prefill_ms'][mode]:.1f} ms")


if __name__ == "__main__":
    main()
