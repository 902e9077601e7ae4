"""Plain-text rendering of a plan and of a layout search (the JSON form is `Plan.as_dict`)."""

from __future__ import annotations

from tessera.config.model import ModelConfig
from tessera.config.parallel import RECOMPUTE_CHOICES
from tessera.plan.activations import korthikanti_layer_bytes, layer_activation_bytes
from tessera.plan.efficiency import get_profile
from tessera.plan.estimate import Plan
from tessera.plan.layout import Layout
from tessera.plan.memory import get_precision, sharding_choices
from tessera.plan.op_time import layer_ops
from tessera.plan.roofline import overlap_window
from tessera.plan.search import SearchResult, time_components

GiB = 2**30


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(t: float) -> str:
    if t >= 0.1:
        return f"{t:.3f} s"
    return f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


def _yaml_value(v: object) -> str:
    """A `parallel` value as YAML (and `--set`) writes it."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def describe_model(cfg: ModelConfig) -> str:
    heads = f"{cfg.n_heads} heads" + (f" ({cfg.n_kv_heads} kv)" if cfg.n_kv_heads != cfg.n_heads and cfg.mla is None
                                      else " (MLA)" if cfg.mla is not None else "")
    text = f"{cfg.family}: dim {cfg.dim}, {cfg.n_layers} layers, {heads}, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}"
    if cfg.moe is not None:
        e = cfg.moe
        text += (f"; MoE {len(cfg.moe_layers)} layers x {e.num_experts} experts (top-{e.top_k}, ffn {e.ffn_dim}"
                 + (f", shared {e.shared_ffn_dim}" if e.shared_ffn_dim else "") + ")")
    return text


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    return lines + [fmt.format(*r) for r in rows]


def _shown_stages(plan: Plan) -> list[int]:
    n = len(plan.stages)
    keep = {0, n - 1, plan.peak.stage}
    return sorted(keep) if n > 3 else list(range(n))


def _header(plan: Plan) -> list[str]:
    """Model, parameters, layout, workload, precision and kernel profile, one line each."""
    cfg, lay, work, cl = plan.model, plan.layout, plan.work, plan.cluster
    prec = get_precision(plan.precision)
    nodes = max(1, cl.gpus // cl.gpus_per_node)
    return [f"Model      {describe_model(cfg)}",
            f"Parameters {_count(plan.params_total)} total" + (
                f", {_count(plan.params_active)} active per token" if cfg.is_moe else ""),
            f"Layout     {lay.describe()} on {cl.gpus} GPUs ({nodes} node(s) x {min(cl.gpus, cl.gpus_per_node)})",
            f"Workload   seq {work.seq_len} x micro-batch {work.micro_batch}, global batch {work.global_batch} "
            f"= {_count(work.tokens)} tokens/step; {plan.microbatches} micro-batch(es) per rank per step",
            f"Precision  model states {prec.name} ({prec.weight_bytes}+{prec.grad_bytes}+{prec.master_bytes}+"
            f"{prec.optimizer_bytes} bytes/param), activations {plan.activation_dtype}",
            f"Kernels    efficiency profile {cl.profile}: {get_profile(cl.profile).note}", ""]


def _memory(plan: Plan) -> list[str]:
    """Memory per rank of the first, last and peak stages, part by part, and what makes the transient peak."""
    lay, cl = plan.layout, plan.cluster
    stages = _shown_stages(plan)
    sel = [plan.stages[s] for s in stages]
    parts = [("weights", lambda s: s.states.weights), ("gradients", lambda s: s.states.gradients),
             ("master weights (fp32)", lambda s: s.states.master), ("optimizer state", lambda s: s.states.optimizer),
             ("ZeRO-3 gather buffers", lambda s: s.states.gathered),
             *([("teacher weights (frozen)", lambda s: s.teacher)] if plan.teacher is not None else []),
             ("activations (in flight)", lambda s: s.activations.stored),
             ("  micro-batches in flight", None),
             *([("  offloaded to host memory", lambda s: s.activations.offloaded)] if lay.activation_offload else []),
             ("transient peak", lambda s: s.activations.transient), ("total", lambda s: s.total)]
    rows = []
    for name, get in parts:
        if get is None:
            rows.append([name] + [f"{s.activations.in_flight:g}" for s in sel])
        else:
            rows.append([name] + [_gib(get(s)) for s in sel])
    out = [f"Memory per rank (GiB; usable {_gib(cl.usable_memory)} of {_gib(cl.gpu_memory)}) -> "
           + ("FITS" if plan.fits else "DOES NOT FIT")]
    out += _table(rows, ["part"] + [f"stage {s} ({plan.stages[s].activations.layers} layers)" for s in stages])
    peak = plan.peak.activations
    reload = f", offload reload {_gib(peak.reload_buffer)}" if lay.activation_offload else ""
    out.append(f"  transient peak = max(recompute buffer {_gib(peak.recompute_buffer)}, logits + loss "
               f"{_gib(peak.logits_buffer)}, MoE dispatch {_gib(peak.dispatch_buffer)}{reload}) on stage "
               f"{plan.peak.stage}")
    return out + [""]


def _sharding(plan: Plan) -> list[str]:
    """The peak stage's model states under each data-parallel sharding choice."""
    lay = plan.layout
    choices = sharding_choices(plan.peak.params, lay, get_precision(plan.precision), plan.microbatches)
    out = [f"Model states of a stage-{plan.peak.stage} rank under each data-parallel choice (GiB; ZeRO over "
           f"dp_shard x cp = {lay.dense_shard}, experts over {lay.expert_shard})"]
    rows = [[name, _gib(c.weights), _gib(c.gradients), _gib(c.master), _gib(c.optimizer), _gib(c.gathered),
             _gib(c.total)] for name, c in choices.items()]
    out += _table(rows, ["sharding", "weights", "gradients", "master", "optimizer", "gather buffers", "total"])
    return out + [""]


def _activations(plan: Plan) -> list[str]:
    """Activation bytes of one dense and one MoE layer under each recompute policy, with and without
    tp (and sp), beside the GPT formula's."""
    cfg, lay, work = plan.model, plan.layout, plan.work
    out = [f"Activations per layer and micro-batch on one rank (GiB, {plan.activation_dtype}, micro-batch "
           f"{work.micro_batch} x {work.seq_len // lay.cp} tokens)"]
    policy = dict(recompute_save=lay.recompute_save, activation_fp8=lay.activation_fp8) if lay.recompute == "op" else {}
    variants = [("no tp", Layout(cp=lay.cp, **policy))]
    if lay.tp > 1:
        variants += [(f"tp={lay.tp}", Layout(tp=lay.tp, cp=lay.cp, **policy)),
                     (f"tp={lay.tp}+sp", Layout(tp=lay.tp, sp=True, cp=lay.cp, **policy))]
    rows = []
    for moe in sorted({cfg.is_moe_layer(i) for i in range(cfg.n_layers)}):
        i = cfg.moe_layers[0] if moe else next(j for j in range(cfg.n_layers) if not cfg.is_moe_layer(j))
        for label, v in variants:
            rows.append([("MoE" if moe else "dense") + f" layer, {label}"] + [
                _gib(layer_activation_bytes(cfg, i, v, work, plan.activation_dtype, recompute=rc))
                for rc in RECOMPUTE_CHOICES])
    for label, v in variants:
        rows.append([f"GPT formula, {label}"] + [_gib(korthikanti_layer_bytes(
            work.seq_len // lay.cp, work.micro_batch, cfg.dim, cfg.n_heads, t=v.tp, sp=v.sp, recompute=rc))
            if rc != "op" else "-" for rc in RECOMPUTE_CHOICES])
    op_label = Layout(recompute="op", **policy).recompute_label()
    out += _table(rows, ["layer", *(op_label if rc == "op" else rc for rc in RECOMPUTE_CHOICES)])
    out.append("  (GPT formula: Korthikanti et al. 2022, 16-bit, stores the s x s scores; ours: flash attention;"
               " op: the block's input and the outputs its save list keeps)")
    return out + [""]


def _flops_and_bubble(plan: Plan) -> list[str]:
    """FLOPs per step (model and with recompute) and the pipeline bubble of each schedule."""
    lay, work, t = plan.layout, plan.work, plan.time
    hw = plan.hardware_flops_per_step
    return [f"FLOPs per step  model {plan.model_flops_per_step:.3e} ({plan.model_flops_per_step / work.tokens:.3e}"
            f" per token; 6 N_active D = {6 * plan.params_active * work.tokens:.3e}), with recompute {hw:.3e}",
            f"Pipeline bubble {100 * t.bubble:.1f}% ({lay.pp_schedule}, p={lay.pp}, m={plan.microbatches}, "
            f"v={lay.vpp}); "
            + ", ".join(f"{k} {100 * v:.1f}%" for k, v in plan.as_dict()["pipeline"]["schedules"].items()), ""]


def _communication(plan: Plan) -> list[str]:
    """Every collective of one rank of the peak stage: volume, link, time and what hides it (none: no lines)."""
    colls = plan.collectives[plan.peak.stage]
    if not colls:
        return []
    cl, m = plan.cluster, plan.microbatches
    rows = []
    for c in colls:
        bw = cl.group_bandwidth(c.group_size, c.stride)
        sent = c.bytes_per_step(m)
        calls = c.calls_per_microbatch * m + c.calls_per_step
        seconds = calls * cl.collective_time(c.bytes_per_call(), c.group_size, c.stride)
        rows.append([c.group, str(c.group_size), c.op, c.what, _bytes(c.size), f"{calls:g}", _bytes(sent),
                     "NVLink" if bw == cl.intra_node_bandwidth else "network", _seconds(seconds),
                     overlap_window(c, plan.layout)])
    out = [f"Communication per step, one rank of stage {plan.peak.stage}"]
    out += _table(rows, ["group", "n", "collective", "what", "buffer", "calls", "sent", "link", "time",
                         "hidden behind"])
    return out + [""]


def _operators(plan: Plan) -> list[str]:
    """The operators of one dense and one MoE layer's forward on one rank: shape, FLOPs, time, share of peak."""
    cfg, lay, work, cl = plan.model, plan.layout, plan.work, plan.cluster
    tokens = work.micro_batch * work.seq_len / lay.cp
    out = []
    for moe in sorted({cfg.is_moe_layer(i) for i in range(cfg.n_layers)}):
        out.append(f"Operators of one {'MoE' if moe else 'dense'} layer, forward of one micro-batch on one rank "
                   f"({tokens:.0f} tokens; backward = 2 x forward)")
        rows = [[o.name, o.shape, f"{o.flops / 1e9:.1f}" if o.flops else "-", _seconds(o.seconds),
                 f"{100 * o.flops / (o.seconds * cl.gpu_flops):.0f}%" if o.flops else "-"]
                for o in layer_ops(cfg, moe, lay, tokens, work.seq_len, cl, plan.activation_dtype)]
        out += _table(rows, ["operator", "shape", "GFLOP", "time", "of peak"])
        out.append("")
    return out


def _step_time(plan: Plan) -> list[str]:
    """The slowest stage's compute split by kind, the step time by component, and the throughput."""
    lay, cl, t, m = plan.layout, plan.cluster, plan.time, plan.microbatches
    comp = time_components(plan)
    slow = max(t.stages, key=lambda st: st.per_microbatch)
    return [f"Compute of stage {slow.stage} per step ({cl.gpu}: large GEMMs at {100 * cl.efficiency:.0f}% of "
            f"{cl.gpu_flops / 1e12:.0f} TFLOP/s, attention up to {100 * cl.attention_efficiency:.0f}%, "
            f"HBM {cl.memory_bandwidth / 1e12:.2f} TB/s): matrix products {_seconds(m * slow.matmul)}, "
            f"attention core {_seconds(m * slow.attention)}, elementwise (memory-bound) {_seconds(m * slow.memory)}"
            + (f", host transfers {_seconds(m * slow.transfer)}" if slow.transfer else "")
            + f" = {100 * plan.hardware_flops_per_step / max(1e-30, t.compute * lay.world * cl.gpu_flops):.0f}% "
            "of peak while computing",
            f"Step time {_seconds(t.total)}: " + ", ".join(f"{k} {_seconds(v)}" for k, v in comp.items()),
            f"Throughput {plan.tokens_per_second:,.0f} tokens/s ({plan.tokens_per_second / cl.gpus:,.0f} per GPU), "
            f"MFU {100 * plan.mfu:.1f}%"]


_PLAN_SECTIONS = (_header, _memory, _sharding, _activations, _flops_and_bubble, _communication, _operators,
                  _step_time)


def render_plan(plan: Plan) -> str:
    """The plan as text: one section after another, each followed by a blank line (the last excepted)."""
    return "\n".join(line for section in _PLAN_SECTIONS for line in section(plan))


def render_search(result: SearchResult, top: int) -> str:
    out = [f"{result.valid} valid layouts, {len(result.ranked)} fit in memory ({result.coverage()})."]
    if not result.ranked:
        out.append("None fits. Smallest peaks:")
        out += [f"  {p.layout.describe()}: {_gib(p.peak.total)} GiB per rank" for p in result.too_big]
        return "\n".join(out)
    rows = []
    for i, p in enumerate(result.ranked[:top]):
        rows.append([str(i + 1), p.layout.describe(), _seconds(p.time.total), f"{100 * p.mfu:.1f}%",
                     _gib(p.peak.total)])
    out += _table(rows, ["#", "layout", "step", "MFU", "peak GiB"])
    out.append("")
    out.append("Why:")
    out += [f"  {i + 1}. {why}" for i, why in enumerate(result.reasons(top))]
    others = result.alternatives()
    if others:
        out += ["", "Against the fastest layout of each other mesh shape:"] + [f"  {line}" for line in others]
    best = result.ranked[0].layout
    out += ["", "parallel section of the best layout (tessera train --set parallel.K=V takes it as is):"]
    out += [f"  {k}: {_yaml_value(v)}" for k, v in best.parallel_settings().items()]
    return "\n".join(out)
