"""The engine flags every model-running command shares, and the EngineConfig they describe."""

from __future__ import annotations

import argparse

from pagoda.node_agent.engine.config import (
    DECODE_LM_HEADS,
    ITL_TARGET_AUTO,
    KV_SCALE_GRANULARITIES,
    EngineConfig,
    ParallelConfig,
    PhaseFormats,
    parse_bytes,
)
from pagoda.vocabulary import (
    DEFAULT_INT4_COMPUTE,
    INT4_COMPUTES,
    INTEGRITY_MODES,
    KV_CACHE_FORMATS,
    SOURCE_DEFAULT,
    WEIGHT_FORMAT_CHOICES,
)

DEFAULT_MODEL = "builtin://smollm2-135m"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags every command that runs the model shares."""
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="builtin://NAME, hf-dir:///DIR, a .gguf file or DIR"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weights/activations/KV precision (float32 is the reference precision)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--prefill-weights",
        choices=WEIGHT_FORMAT_CHOICES,
        default=None,
        help="prefill weights; auto (as leaving the flag out): stored for a checkpoint released "
        "quantized, else fp8",
    )
    p.add_argument(
        "--prefill-kv",
        choices=KV_CACHE_FORMATS,
        default=None,
        help="prefill KV pages (default bf16)",
    )
    p.add_argument(
        "--decode-weights",
        choices=WEIGHT_FORMAT_CHOICES,
        default=None,
        help="decode weights; auto (as leaving the flag out): stored for a checkpoint released "
        "quantized, else int4",
    )
    p.add_argument(
        "--decode-kv",
        choices=KV_CACHE_FORMATS,
        default=None,
        help="decode KV pages: int8 (default; K and V int8 with a scale per token and head), fp8_e4m3 "
        "or bf16",
    )
    p.add_argument("--kv-memory", default=None, help="KV cache budget, e.g. 512MiB (default: 1GiB on CPU)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.9, help="of free GPU memory (CUDA)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--itl-target-ms",
        type=parse_itl_target,
        default="auto",
        help="time-budgeted steps: a prefill step may take what the inter-token target leaves after the "
        "running batch's decode step; auto (default: 2x the decode step measured for the running batch), "
        "a target in ms, or off (steps sized by --max-num-batched-tokens alone)",
    )
    p.add_argument(
        "--min-prefill-tokens",
        type=int,
        default=32,
        help="the time budget's floor: prompt tokens every prefill step may take, so prefill always "
        "progresses (capped at --max-num-batched-tokens)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to render chats with instead of the model's own (e.g. one that "
        "takes tools=, for tool calls in the model's format)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="a trust decision: let a model whose tokenizer is custom Python code in its directory "
        "(Kimi-K2's tiktoken tokenizer) run that code in this process; off, such a model is refused",
    )
    p.add_argument(
        "--int4-group-size",
        type=int,
        default=None,
        help="INT4 group size (default: 128 where it divides K, else 64, else 32)",
    )
    p.add_argument("--integrity", choices=INTEGRITY_MODES, default="enforce")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="integrity drills and tests only: allow injecting KV faults (never for production)",
    )
    p.add_argument(
        "--fault-corrupt-layer",
        type=int,
        default=None,
        metavar="N",
        help="quality drill (needs --enable-fault-injection): scale layer N's output projections "
        "(o_proj, down_proj; their quantization scales when stored quantized) by --fault-corrupt-scale at load",
    )
    p.add_argument(
        "--fault-corrupt-scale",
        type=float,
        default=None,
        metavar="S",
        help="the factor of --fault-corrupt-layer (default 1.5)",
    )
    p.add_argument("--kernels", default=None, help="force a kernel backend: reference, cpu or triton")
    p.add_argument(
        "--decode-lm-head",
        choices=DECODE_LM_HEADS,
        default="auto",
        help="the decode phase's LM head: auto (int8 where int8 blocks hold it exactly, as GGUF Q8_0, with "
        "float32 compute on a CPU; else dense), dense (the compute dtype), int8 (per row unless exact) or "
        "int4 (group 32)",
    )
    p.add_argument(
        "--int4-compute",
        choices=INT4_COMPUTES,
        default=DEFAULT_INT4_COMPUTE,
        help="CPU INT4 GEMMs with float32 activations: float32 (exact, a native kernel) or bf16 "
        "(torch's int4pack op, faster, rounds activations and scales to bf16)",
    )
    p.add_argument(
        "--allow-kernel-fallback",
        action="store_true",
        help="run the torch paths when the native CPU kernels fail to build (default: an error where a "
        "C compiler exists; also PAGODA_ALLOW_KERNEL_FALLBACK=1)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step's elementwise glue at load (falls back to eager, saying why)",
    )
    p.add_argument(
        "--kv-scale-granularity",
        choices=KV_SCALE_GRANULARITIES,
        default="per-token-k",
        help="fp8_e4m3 KV scales: per-token-k (K per token and head, V static per head), per-head or "
        "per-tensor (static, calibrated at load); int8 KV always scales per token and head",
    )
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """One model replica over several ranks (torch.distributed; engine/parallel/group.py)."""
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="ranks of one replica (heads, MLP widths, vocab and experts split over them); on one "
        "host Pagoda starts them itself",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="hosts of the replica, each running tensor-parallel / nodes ranks (host index from "
        "$PAGODA_NODE_RANK, $NODE_RANK or $LWS_WORKER_INDEX)",
    )
    p.add_argument(
        "--dist-addr",
        default=None,
        help="rank 0's host (default: $MASTER_ADDR, $LWS_LEADER_ADDRESS; localhost on one host)",
    )
    p.add_argument(
        "--dist-port",
        type=int,
        default=None,
        help="rank 0's rendezvous port (default: $MASTER_PORT or 29500)",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        help="seconds a collective may take: a rank that dies or hangs fails the replica within it",
    )


def parse_itl_target(text: str) -> str:
    """--itl-target-ms: auto, off or a positive number of milliseconds (checked here, kept as text)."""
    t = text.strip().lower()
    if t in ("auto", "off"):
        return t
    try:
        ok = float(t) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected auto, off or milliseconds > 0, got {text!r}")
    return t


def itl_target_ms(text: str) -> float | None:
    """EngineConfig.itl_target_ms of an --itl-target-ms value (off: None, auto: ITL_TARGET_AUTO)."""
    return None if text == "off" else ITL_TARGET_AUTO if text == "auto" else float(text)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe (float32 alone means reference formats).

    A weights flag set to ``auto`` is the flag left out (the operator passes it so)."""
    names = ("prefill_weights", "prefill_kv", "decode_weights", "decode_kv")
    given = {n: v for n in names if (v := getattr(a, n, None)) and v != SOURCE_DEFAULT}
    # float32 is the reference precision: dense weights and KV unless formats are asked for
    f = PhaseFormats.reference() if a.dtype == "float32" and not given else PhaseFormats()
    for name, value in given.items():
        setattr(f, name, value)
    return EngineConfig(
        model=a.model,
        dtype=a.dtype,
        device=a.device,
        formats=f,
        kv_memory=parse_bytes(a.kv_memory) if a.kv_memory else None,
        kv_memory_fraction=a.kv_memory_fraction,
        page_size=a.page_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        itl_target_ms=itl_target_ms(getattr(a, "itl_target_ms", "off")),
        min_prefill_tokens=getattr(a, "min_prefill_tokens", 32),
        max_model_len=a.max_model_len,
        chat_template=getattr(a, "chat_template", None),
        trust_remote_code=getattr(a, "trust_remote_code", False),
        integrity=a.integrity,
        int4_group_size=getattr(a, "int4_group_size", None),
        enable_prefix_caching=not a.no_prefix_caching,
        fault_injection=getattr(a, "enable_fault_injection", False),
        corrupt_layer=getattr(a, "fault_corrupt_layer", None),
        corrupt_scale=1.5 if getattr(a, "fault_corrupt_scale", None) is None else a.fault_corrupt_scale,
        kernel_backend=a.kernels,
        decode_lm_head=getattr(a, "decode_lm_head", "auto"),
        compile=getattr(a, "compile", False),
        int4_compute=getattr(a, "int4_compute", DEFAULT_INT4_COMPUTE),
        allow_kernel_fallback=getattr(a, "allow_kernel_fallback", False),
        kv_scale_granularity=getattr(a, "kv_scale_granularity", "per-token-k"),
        parallel=ParallelConfig(
            tensor_parallel=getattr(a, "tensor_parallel", 1),
            nodes=getattr(a, "nodes", 1),
            dist_addr=getattr(a, "dist_addr", None),
            dist_port=getattr(a, "dist_port", None),
            dist_timeout=getattr(a, "dist_timeout", 60.0),
        ),
    )


def _engine_flag_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return [act for act in parser._actions if act.option_strings]


# every engine flag, derived from add_engine_args (dest -> flag); the switches take no value
SERVER_ENGINE_FLAGS = {act.dest: act.option_strings[0] for act in _engine_flag_actions() if act.nargs != 0}
SERVER_ENGINE_SWITCHES = {act.dest: act.option_strings[0] for act in _engine_flag_actions() if act.nargs == 0}


def engine_argv(a: argparse.Namespace) -> list[str]:
    """The engine flags set in ``a`` as a command line (for a server started by ``pagoda bench serve``)."""
    out: list[str] = []
    for dest, flag in SERVER_ENGINE_FLAGS.items():
        v = getattr(a, dest, None)
        if v not in (None, "", False):
            out += [flag, str(v)]
    return out + [flag for dest, flag in SERVER_ENGINE_SWITCHES.items() if getattr(a, dest, False)]
