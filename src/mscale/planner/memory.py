"""Memory per GPU: what this project's engine allocates, buffer by buffer, and when.

`rank_memory` is what cost.py charges. It prices the engine as written (parallel/data.py,
param_gather.py, zero.py, model/transformer.py, pipeline/runner.py), not Megatron's accounting:

- **Parameters are fp32**, one flat buffer (param_gather.py), whatever the precision; bf16 runs
  use autocast. Under bf16 every linear casts its weight to bf16 once per step: the engine holds
  one autocast context (its cache) over the step's forwards and backwards (train/engine.py
  ``cast_scope``), so every micro-batch in flight shares that copy, 2 bytes per matrix weight of
  the rank, all its chunks, whatever the schedule. (One context per chunk forward kept a copy
  per micro-batch in flight: ~50 GB per GPU for 175B at tp 8 pp 8 v 6.) Full recompute keeps
  the context per forward: the graph keeps no copy, and recompute makes a block's again.
- **Gradients are one fp32 buffer** the size of the parameters. ZeRO 0/1 keep it always; ZeRO 2
  (dp > 1) allocates each bucket at its first gradient of the step and frees it after its
  reduce-scatter in ``finish()``, so it is alive through every backward, i.e. at the peak: ZeRO-2
  saves memory only around the optimizer step and between steps, not at the peak. ZeRO 1/2 add
  a 1/dp shard buffer. (The planner used to divide gradients by dp under ZeRO-2: for 175B on
  12,288 A100s that priced the best layout ~59 GB under what ``train`` would allocate.)
- **Optimizer**: Adam m and v, fp32, over the owned space (everything under ZeRO 0, 1/dp under
  ZeRO 1/2); fp32 master weights only under ZeRO 1/2 at dp > 1 (elsewhere the master *is* the
  flat parameter buffer). The step's temporaries (``sqrt`` of v; LAMB's direction) are one or
  two owned-sized fp32 tensors, while the ZeRO-2 buckets are already freed.
- **Activations** per block and micro-batch from the tensors autograd keeps (`block_saved_bytes`),
  for this model's shapes: grouped-query K/V, SwiGLU or GeLU width, parallel or sequential
  block, fp32 residual stream and norms, flash-style attention (no s×s tensor on a GPU).
- **Pipeline**: micro-batches in flight per rank from the engine's own schedule
  (`in_flight_chunks`, checked against parallel/pipeline/schedule.py by a test), plus each
  in-flight chunk's output held for its backward and the receives posted ahead (one under 1F1B,
  two under interleaving: parallel/pipeline/posting.py).
- **Host**: the checkpoint's pinned arena (ckpt/snapshot.py) is host memory, reported apart.

Every function works on numbers and numpy arrays alike, so the search evaluates all layouts at
once with the code that evaluates one. Measured against the engine's peak by
tests/distributed/test_memory_peak.py (CPU) and bench/gpu_memory_check.py (GPU).
"""

from __future__ import annotations

import numpy as np

from mscale.planner import flops
from mscale.planner.constants import STATE_BYTES

RECOMPUTE_CODES = {"none": 0, "selective": 1, "full": 2}
"""Recompute modes as integers, for vectorised evaluation."""

FP32 = 4
"""Bytes of an fp32 element: parameters, gradients, optimizer state, residual stream, norms."""


def in_flight_chunks(p, v, m, rank):
    """Most chunk forwards whose backward has not run yet on pipeline rank ``rank``.

    The engine's schedule (parallel/pipeline/schedule.py, Megatron's order) warms up with
    ``2·(p−1−r) + (v−1)·p`` forwards under interleaving and ``p−1−r`` under 1F1B, then
    alternates; one more forward is in flight at the first backward. Never more than the step's
    ``m·v`` chunk forwards. A chunk holds 1/v of the rank's blocks.
    """
    p, v, m, r = (np.asarray(x) for x in (p, v, m, rank))
    warm = np.where(v > 1, 2 * (p - 1 - r) + (v - 1) * p, p - 1 - r)
    return np.where(p == 1, 1, np.minimum(warm + 1, m * v))


def in_flight_micro_batches(p, v, m):
    """Micro-batches' worth of its blocks that the first pipeline rank holds at its peak:
    ``in_flight_chunks / v`` (1F1B: min(p, m); interleaved: p·(1 + (p−1)/(p·v)))."""
    return in_flight_chunks(p, v, m, 0) / np.asarray(v)


def sp_split(t, sp):
    """What the residual stream is divided by: t under sequence parallelism, else 1."""
    t = np.asarray(t)
    return np.where(np.asarray(sp, dtype=bool) & (t > 1), t, 1)


def block_saved_bytes(model, b, t, sp, rec, precision: str, cuda: bool = True):
    """Bytes one block keeps for its backward, per micro-batch of ``b`` sequences.

    From the tensors the engine's autograd graph keeps (model/transformer.py), n = s·b tokens:

    - each RMSNorm: its fp32 input and normalised output (``2·4·n·h``), /t under SP;
    - the input of every linear that reads the entered stream: bf16 autocast casts it once per
      linear (Q, K, V, gate, up: ``2·n·h`` each, full sequence even under SP, where it is the
      all-gathered stream); fp32 runs keep the one entered tensor per `enter` (``4·n·h``);
    - attention, per TP rank: rotated Q and K, V (``e·n·(h + 2·kv)/t``), the output, kept
      once for the kernel's backward and the O projection (``e·n·h/t``; measured on CPU: the
      reshape is a view), the fp32 log-sum-exp (``4·n·heads/t``); selective recompute drops
      only the log-sum-exp (flash attention keeps no s×s tensor, so there is next to nothing
      for it to save: in this engine selective costs FLOPs and saves ~nothing);
    - MLP: SwiGLU keeps gate, its SiLU, up and their product (``4·e·n·f/t``), GeLU two
      (``2·e·n·f/t``);
    - full recompute: only the block's fp32 input, ``4·n·h``, /t under SP;
    - fp32 on CUDA: no flash kernel takes fp32, and the fallback keeps the fp32 attention
      probabilities, ``4·b·(heads/t)·s²`` (measured on an H200: 0.49 GiB a block at b 2, 16
      heads, s 2048; bench/gpu_memory_check.py). CPU (``cuda`` False) has an fp32 flash kernel.

    e = 2 under bf16, 4 under fp32. ``rec`` is a code from RECOMPUTE_CODES.
    """
    e = 2 if precision == "bf16" else FP32
    s, h, a = model.seq_len, model.hidden, model.heads
    kv, f = model.num_kv_heads * model.head_dim, model.ffn
    n = s * np.asarray(b, dtype=float)
    t, rec = np.asarray(t), np.asarray(rec)
    tsp = sp_split(t, sp)
    norms = 1 if model.parallel_block else 2
    linears = 3 + (2 if model.mlp == "swiglu" else 1)
    lin_in = linears * e * n * h if e == 2 else norms * FP32 * n * h
    core_out = FP32 * n * a / t  # the log-sum-exp; the output is the O projection's input
    if e == FP32 and cuda:
        core_out = core_out + FP32 * n * s * a / t  # fp32 probabilities, b·heads·s² per block
    attn = e * n * (2 * h + 2 * kv) / t + core_out  # Q, K, V, the output, + log-sum-exp
    mlp = (4 if model.mlp == "swiglu" else 2) * e * n * f / t
    kept = norms * 2 * FP32 * n * h / tsp + lin_in + attn + mlp
    return np.select([rec == 0, rec == 1], [kept, kept - core_out], FP32 * n * h / tsp)


def block_transient_bytes(model, b, t, precision: str):
    """Working memory of one block's backward on top of what it keeps (an estimate, checked by
    the peak tests): the MLP's input gradients (three ``e·n·f/t`` tensors while SiLU·up is
    differentiated), the stream's gradient in fp32 and its bf16 cast, and the fp32 gradient
    of the largest weight before it is added into the buffer (6 bytes per element under
    autocast: the bf16 product and its fp32 cast)."""
    e = 2 if precision == "bf16" else FP32
    s, h, f = model.seq_len, model.hidden, model.ffn
    n = s * np.asarray(b, dtype=float)
    t = np.asarray(t)
    weight = (e + FP32 if e == 2 else FP32) * h * max(f, model.heads * model.head_dim) / t
    return 3 * e * n * f / t + (FP32 + e) * n * h + weight


def logits_bytes(model, b, t, precision: str):
    """The last stage's loss at its peak, per micro-batch: the vocabulary slice's logits (bf16),
    their fp32 copy, the shifted logits and the exponentials that become the kept softmax
    (parallel/tensor.py `vocab_parallel_cross_entropy`): 14 bytes per logit (12 in fp32)."""
    per = 14 if precision == "bf16" else 12
    return per * model.seq_len * np.asarray(b, dtype=float) * model.vocab / np.asarray(t)


def rank_params(model, layers, tp, embedding, head):
    """Parameters one rank holds: its blocks' matrices /tp, norm gains whole (replicated over
    TP), and the embedding / final norm + head when it has them."""
    h, v = model.hidden, model.vocab
    norms = (1 if model.parallel_block else 2) * h
    per_block = flops.layer_matrix_params(model) / np.asarray(tp) + norms
    head_p = np.where(head, h + (0 if model.tie_embeddings else v * h / np.asarray(tp)), 0)
    return layers * per_block + np.where(embedding, v * h / np.asarray(tp), 0) + head_p


def weight_copy_bytes(model, layers, tp, rec, head, bf16: bool):
    """The bf16 autocast copies of one rank's weights alive at its peak: one per matrix weight
    of its ``layers`` blocks, shared by all micro-batches of the step (the engine's step-long
    ``cast_scope``), not one per micro-batch in flight; none under full recompute (``rec`` 2,
    where the scope is per forward and the graph keeps no copy); plus the head's (or the tied
    embedding's) on the rank that computes the logits. Embedding lookups are not cast."""
    block_copy = 2.0 * flops.layer_matrix_params(model) / np.asarray(tp) if bf16 else 0.0
    blocks = np.where(np.asarray(rec) == 2, 0.0, block_copy * np.asarray(layers))
    return blocks + np.where(np.asarray(head) & bf16, 2.0 * model.vocab * model.hidden
                             / np.asarray(tp), 0.0)


def state_bytes(precision: str, dp, zero):
    """Bytes per parameter of the engine's persistent state on one rank, by buffer.

    ``params`` the flat fp32 buffer; ``grad_buffer`` the fp32 gradient buckets (alive at the
    peak under every ZeRO stage, see the module docstring); ``grad_shard`` the reduce-scatter
    target; ``master`` the fp32 master shard (aliases the parameters where a rank owns the
    whole buffer); ``moments`` Adam m and v over the owned space.
    """
    dp, zero = np.asarray(dp), np.asarray(zero)
    sharded = (zero >= 1) & (dp > 1)
    owned = np.where(sharded, 1 / dp, 1.0)
    return {
        "params": np.full(np.shape(owned), float(FP32)),
        "grad_buffer": np.full(np.shape(owned), float(FP32)),
        "grad_shard": np.where(sharded, FP32 / dp, 0.0),
        "master": np.where(sharded, FP32 / dp, 0.0),
        "moments": 2 * FP32 * owned,
    }


def state_bytes_per_param(precision: str, dp, zero):
    """Megatron-LM's accounting (bf16 weights, fp32 main gradients divided by dp under ZeRO-2,
    fp32 master + Adam), for comparison with published figures; not what this engine
    allocates (`state_bytes`)."""
    b = STATE_BYTES[precision]
    dp, zero = np.asarray(dp), np.asarray(zero)
    return {
        "weights": np.full(np.shape(dp), float(b["weight"])),
        "gradients": np.where(zero >= 2, b["grad"] / dp, float(b["grad"])),
        "optimizer": np.where(zero >= 1, b["optimizer"] / dp, float(b["optimizer"])),
    }


def activation_bytes_per_layer(s, b, h, a, t, sp, recompute):
    """Korthikanti et al. (arXiv 2205.05198) for a GPT block without flash attention, kept for
    comparison with published figures: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` and its SP,
    selective and full forms (docs/references.md). The engine's own figure is
    `block_saved_bytes`."""
    sbh = s * b * h
    score = 5 * a * s / h
    sp = np.asarray(sp, dtype=bool) & (np.asarray(t) > 1)
    none = np.where(sp, sbh * (34 + score) / t, sbh * (10 + 24 / t + score / t))
    selective = np.where(sp, 34 * sbh / t, sbh * (10 + 24 / t))
    full = np.where(sp, 2 * sbh / t, 2 * sbh)
    return np.select([recompute == 0, recompute == 1], [none, selective], full)


def megatron_block_bytes(model, b, t, sp, rec, flash: bool):
    """`activation_bytes_per_layer`'s count, tensor by tensor, for this model's shapes: equal to
    it for a GPT block (K/V as wide as Q, a 4h GeLU MLP, no flash kernel), and otherwise

    - replicated, or /t under SP: both norms' inputs, the QKV and first-MLP-linear inputs and
      two dropout masks, ``10·s·b·h`` (Korthikanti's count, kept whole);
    - per TP rank: Q and the attention output ``2·2·s·b·h``, K and V ``2·2·s·b·kv`` (grouped-
      query heads keep fewer), the MLP's kept tensors ``2·2·s·b·f`` for GeLU (its input and
      output) or ``3·2·s·b·f`` for SwiGLU (gate and up, and their product);
    - the attention scores ``5·a·s²·b`` per TP rank unless the stack runs a flash kernel, which
      keeps none: there recompute "none" costs what "selective" does.

    ``rec`` is a code from RECOMPUTE_CODES; full recompute keeps the block input, ``2·s·b·h``."""
    s, h, a = model.seq_len, model.hidden, model.heads
    kv, f = model.num_kv_heads * model.head_dim, model.ffn
    t, rec = np.asarray(t), np.asarray(rec)
    sb = s * np.asarray(b, dtype=float)
    tsp = sp_split(t, sp)
    mlp_kept = 3 if model.mlp == "swiglu" else 2
    per_rank = (4 * sb * h + 4 * sb * kv + 2 * mlp_kept * sb * f) / t
    scores = 0.0 if flash else 5 * a * s * sb / t
    kept = 10 * sb * h / tsp + per_rank
    return np.select([rec == 0, rec == 1], [kept + scores, kept], 2 * sb * h / tsp)


def rank_memory(pb, c: dict, micro) -> dict:
    """Bytes per GPU of every candidate in ``c`` (cost.py's arrays), at the largest of the
    first, the middle and the last pipeline rank's peaks (the first holds the most micro-batches
    in flight, the last the head and the loss, a middle one may hold the most blocks: an uneven
    split puts its extra blocks in the centre), with the parts of that rank. The middle ranks
    are priced at rank 1 (the most micro-batches in flight of any) and at the first rank holding
    the most blocks (cost.py `counts_of`): the fullest middle rank for every split the search
    makes (two middle block counts), a bound above it for a hand-written ``stage_layers``. What
    is approximated, as ever, is the activations of a rank whose chunks differ in size (light
    and uneven splits at vpp > 1, as the search makes them, and hand-written ones): each chunk
    is priced as 1/v of the rank's blocks (`in_flight_chunks`), while the warm-up fills the
    first chunks before the last; a review measured 9-33% fewer block-micro-batches priced
    than held on the worst rank of such splits (the first rank, usually the fullest, is exact
    at vpp 1).

    Keys: cost.py's ``rank_params, mem_weights, mem_gradients, mem_optimizer, mem_activations,
    mem_logits, mem_total, mem_budget, fits``, plus ``mem_weight_copies`` (the bf16 weight
    copies inside ``mem_activations``) and ``host_pinned`` (the checkpoint's host arena; not
    GPU memory, not in ``mem_total``). A training file that names another stack (one with bf16
    weights and Megatron's accounting, e.g. ``megascale``) is priced by `megatron_memory`.
    """
    profile = getattr(pb, "stack_profile", None)
    if profile is not None and not profile.this_engine:
        return megatron_memory(pb, c, micro)
    pp = np.asarray(c["pp"])
    single = pp == 1
    first = _rank_peak(pb, c, micro, 0, c["first_layers"], True, single)
    last = _rank_peak(pb, c, micro, pp - 1, c["last_layers"], single, True)
    second = _rank_peak(pb, c, micro, np.minimum(1, pp - 1), c["second_layers"], False, False)
    fullest = _rank_peak(pb, c, micro, c["mid_at"], c["mid_layers"], False, False)
    peaks = [first, last, second, fullest]
    totals = np.stack([first["mem_total"], last["mem_total"],
                       np.where(pp > 2, second["mem_total"], -1.0),
                       np.where(pp > 2, fullest["mem_total"], -1.0)])
    worst = np.argmax(totals, axis=0)  # ties: the first listed
    out = {k: np.choose(worst, [p[k] for p in peaks]) for k in first}
    out["mem_budget"] = np.full(np.shape(out["mem_total"]), pb.budget_bytes)
    out["fits"] = out["mem_total"] <= pb.budget_bytes
    return out


def _rank_peak(pb, c: dict, micro, rank, layers, embedding, head) -> dict:
    """One pipeline rank's peak: the larger of backward (states, gradient buffer, everything in
    flight, one block's working set) and the optimizer step (states and the step's temporaries,
    ZeRO-2 buckets already freed)."""
    m_, tr = pb.model, pb.training
    prec, bf16 = tr.precision, tr.precision == "bf16"
    tp, pp, vpp, dp = (np.asarray(c[k]) for k in ("tp", "pp", "vpp", "dp"))
    mb, sp, rec, zero = c["mb"], c["sp"], np.asarray(c["rec"]), np.asarray(c["zero"])
    n_h = m_.seq_len * np.asarray(mb, dtype=float) * m_.hidden
    params = rank_params(m_, layers, tp, embedding, head)
    st = state_bytes(prec, dp, zero)
    weights = params * st["params"]
    grads = params * (st["grad_buffer"] + st["grad_shard"])
    optimizer = params * (st["master"] + st["moments"])

    chunks = in_flight_chunks(pp, vpp, micro, rank)
    worth = chunks / vpp  # micro-batches' worth of this rank's blocks
    copies = weight_copy_bytes(m_, layers, tp, rec, head, bf16)
    cuda = pb.cluster.gpu.name != "cpu"
    saved = block_saved_bytes(m_, mb, tp, sp, rec, prec, cuda) * layers * worth
    stream = FP32 * n_h / sp_split(tp, sp)  # one micro-batch's residual stream on this rank
    # receives in flight (parallel/pipeline/posting.py): 1F1B posts the next action's only;
    # interleaving may hold the next forward's and the next backward's
    ahead = np.where(np.asarray(vpp) > 1, 2, 1)
    boundary = np.where(pp > 1, (chunks - np.where(head, 1, 0) + ahead) * stream, 0.0)
    block_copy = 2.0 * flops.layer_matrix_params(m_) / tp if bf16 else 0.0 * tp
    recompute = np.where(rec == 2, block_saved_bytes(m_, mb, tp, sp, 0, prec, cuda) + block_copy,
                         0.0)
    window = m_.seq_len ** 2 if m_.sliding_window and m_.sliding_window < m_.seq_len else 0
    work = block_transient_bytes(m_, mb, tp, prec) + recompute + window
    head_kept = np.where(head, 2 * stream + (2 if bf16 else FP32) * n_h, 0.0)
    logits = np.where(head, logits_bytes(m_, mb, tp, prec), 0.0)
    activations = saved + copies + boundary + work + head_kept
    backward = weights + grads + optimizer + activations + logits

    owned = np.where((zero >= 1) & (dp > 1), params / dp, params)
    temps = (2 if tr.optimizer == "lamb" else 1) * FP32 * owned
    freed = np.where((zero >= 2) & (dp > 1), params * st["grad_buffer"], 0.0)
    step = weights + grads - freed + optimizer + temps
    return {"rank_params": params, "mem_weights": weights, "mem_gradients": grads,
            "mem_optimizer": optimizer, "mem_activations": activations, "mem_logits": logits,
            "mem_weight_copies": copies, "mem_total": np.maximum(backward, step),
            "host_pinned": 3 * FP32 * params / dp}


def megatron_memory(pb, c: dict, micro) -> dict:
    """Megatron-LM's accounting, for stacks other than this engine (published runs): bf16
    weights, fp32 gradients (divided by dp under ZeRO-2), master + Adam divided by dp under
    ZeRO ≥ 1 (`state_bytes_per_param`), Korthikanti's activations for this model's shapes and the
    stack's attention kernel (`megatron_block_bytes`), fp32 logits of one micro-batch on the last rank."""
    m_, tp, pp, vpp = pb.model, c["tp"], np.asarray(c["pp"]), np.asarray(c["vpp"])
    p_layer, emb = flops.layer_params(m_), m_.vocab * m_.hidden
    single = emb + (0 if m_.tie_embeddings else emb) + m_.hidden
    first_p = (c["first_layers"] * p_layer + np.where(pp == 1, single, emb)) / tp
    last_p = (c["last_layers"] * p_layer + np.where(pp == 1, single, emb + m_.hidden)) / tp
    per_param = state_bytes_per_param(pb.training.precision, c["dp"], c["zero"])
    flash = bool(getattr(getattr(pb, "stack_profile", None), "flash_attention", False))
    per_layer = megatron_block_bytes(m_, c["mb"], tp, c["sp"], c["rec"], flash)
    first_act = per_layer * c["first_layers"] * in_flight_chunks(pp, vpp, micro, 0) / vpp
    last_act = per_layer * c["last_layers"] * in_flight_chunks(pp, vpp, micro, pp - 1) / vpp
    # the middle ranks as in `rank_memory`: rank 1, and the first holding the most blocks
    second_p = c["second_layers"] * p_layer / tp
    second_act = per_layer * c["second_layers"] * in_flight_chunks(pp, vpp, micro, 1) / vpp
    full_p = c["mid_layers"] * p_layer / tp
    full_act = per_layer * c["mid_layers"] * in_flight_chunks(pp, vpp, micro, c["mid_at"]) / vpp
    logits = 4 * m_.seq_len * c["mb"] * m_.vocab / tp
    state = sum(per_param.values())
    totals = np.stack(np.broadcast_arrays(
        first_p * state + first_act, last_p * state + last_act + logits,
        np.where(pp > 2, second_p * state + second_act, -1.0),
        np.where(pp > 2, full_p * state + full_act, -1.0)))
    worst = np.argmax(totals, axis=0)
    params = np.choose(worst, [first_p, last_p, second_p, full_p])
    total = totals.max(axis=0)
    out = {"rank_params": params,
           "mem_activations": np.choose(worst, [first_act, last_act, second_act, full_act]),
           "mem_logits": np.where(worst == 1, logits, 0.0), "mem_total": total,
           "mem_weight_copies": np.zeros(np.shape(total)), "host_pinned": 12 * params / c["dp"],
           "mem_budget": np.full(np.shape(total), pb.budget_bytes),
           "fits": total <= pb.budget_bytes}
    for k in ("weights", "gradients", "optimizer"):
        out[f"mem_{k}"] = params * per_param[k]
    return out
