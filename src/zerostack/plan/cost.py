"""Predicted step time of one layout: compute, the pipeline bubble, and every collective.

Pure arithmetic. For a GPT-style :class:`~zerostack.estimate.Transformer`, a global batch of
``batch`` sequences and a :class:`Candidate` layout on a :class:`~.hardware.Hardware`:

* **compute**: the model's flops (:mod:`zerostack.profiling.flops`, Narayanan et al., SC'21:
  forward 24 B s l h^2 (1 + s / 6h) + 2 B s h V; backward twice that; full recompute one more
  forward, selective the attention core's 4 B s^2 l h again) split over dp x tp x pp, at
  ``peak x matmul_efficiency``; when pp does not divide the layers, the busiest stage's share
  (:meth:`~zerostack.estimate.Transformer.stage_layers`) paces the step;
* **pipeline bubble**: the schedule run by :func:`zerostack.pipeline.simulate.simulate` (1F1B,
  or interleaved with ``chunks`` model chunks per rank; backward twice a forward), which also
  gives the micro-batches the first stage holds; past 20,000 instructions in all, the closed
  form the simulator agrees with, ``(pp - 1) / (gas x chunks)``;
* **tensor parallelism**: per layer and micro-batch, 2 all-reduces of ``b s h`` values in forward
  and 2 in backward (2 more per recomputed forward), never overlapped;
* **pipeline sends**: an activation and its gradient per micro-batch per stage boundary, each of
  a rank's ``chunks`` model chunks its own boundary;
* **data parallelism**, per step, as zerostack's strategies issue them (``psi`` = parameters of one
  tp x pp slice): stages 0-1 reduce the gradients once and (stage 1) gather the stepped pieces;
  stage 2 reduce-scatters every micro-step; stage 3 also all-gathers the parameters for forward
  and again for backward every micro-step. Gradient reduction overlaps backward; stage 3's
  gathers overlap compute (prefetch): what exceeds the overlapped compute is exposed, and the
  compute runs slower beside the collectives (``Hardware.overlap_slowdown``);
* **optimizer**: Adam on the device (memory bound), or offloaded: gradients to the host,
  CPU Adam, the parameters back.

Ring collectives over ``n`` ranks move ``(n - 1) / n`` of the buffer per rank per reduce-scatter
or all-gather (twice for an all-reduce), with ``n - 1`` latency hops; a group that spans nodes
runs at the inter-node bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from ..estimate import Layout, Transformer, Workload, estimate
from ..estimate.memory import PRECISION_BYTES
from ..pipeline.schedule import build_streams
from ..pipeline.simulate import simulate
from ..profiling.flops import transformer_flops
from .hardware import Hardware


@dataclass(frozen=True)
class Software:
    """How the step is implemented, which sets what it spends beyond its matmuls.

    ``flash``: the attention core is one fused kernel (FlashAttention; torch's
    ``scaled_dot_product_attention`` on a GPU, as zerostack's models call it); False: the s x s
    scores are materialised and pass through HBM (scale, mask, softmax, dropout), as Megatron
    and DeepSpeed ran before 2022. ``fused``: elementwise work is fused (Megatron's and Apex's
    kernels, or ``torch.compile``); False: eager PyTorch, one kernel per operation.
    ``sequence_parallel``: under tp, the LayerNorms, dropouts and residuals are split over the
    tp ranks (Korthikanti et al. 2022); False: every tp rank runs them whole.
    ``overlap_grad_reduce``: data parallelism's gradient reduction runs during backward (as
    zerostack, DDP, DeepSpeed and FSDP do); False: after it (Megatron-LM's own DDP until 2023).
    ``regather``: stage 3 gathers a layer's parameters again for its recomputed forward
    (DeepSpeed's hooks release them after every forward); False: backward's gather serves it.
    ``scatter_gather``: without sequence parallelism, each tp rank sends 1/tp of an activation
    to the next pipeline stage, whose tp ranks all-gather it (Megatron's scatter/gather,
    Narayanan et al. 2021, section 4.1); False: each tp rank sends it whole, as zerostack's
    pipeline does (with sequence parallelism the activation is already 1/tp).
    ``prefetch``: how far ahead stage 3 gathers. "layer": the next layer's parameters while
    this layer computes (FSDP's block ahead; zerostack's bucket of the two largest modules), so
    only what the gathers exceed of the compute is exposed; "matrix": the next matrix only,
    while this one computes (DeepSpeed's ``stage3_prefetch_bucket_size``, 5e7 elements by
    default, holds less than one matrix of a 100B-scale model), so a large matrix's gather
    waits on a small one's compute (:func:`matrix_chain`).
    ``step_grad_copy``: the optimizer step casts the 16-bit gradients it steps to an fp32 copy
    that lives beside the model states until the next step's ``zero_grad`` (Megatron-LM's fp16
    optimizer in 2021, ``main_param.grad = model_param.grad.float()``, before its fp32 gradient
    buffers); backward's activations are freed by then, so the rank's peak is the larger of the
    two on top of its states. False: gradients are stepped where they are (zerostack).
    ``pipeline_zero``: the highest ZeRO stage the software runs beside a pipeline (zerostack,
    as DeepSpeed, 1; FSDP under a pipeline, as Llama 3 and torchtitan train, 3).
    ``distribute_saved``: without sequence parallelism, full recompute's kept layer inputs are
    split over the tp ranks, and backward all-gathers each before recomputing its layer
    (Megatron's ``--distribute-saved-activations``, metaseq's
    ``--distribute-checkpointed-activations``)."""

    flash: bool = True
    fused: bool = False
    sequence_parallel: bool = True
    overlap_grad_reduce: bool = True
    regather: bool = True
    scatter_gather: bool = False
    prefetch: str = "layer"
    step_grad_copy: bool = False
    pipeline_zero: int = 1
    distribute_saved: bool = False


@dataclass(frozen=True)
class Candidate:
    """One layout to price: the grid, ZeRO stage, micro-batch, recompute and offload."""

    dp: int
    tp: int
    pp: int
    stage: int
    micro_batch: int
    gas: int
    recompute: str = "none"
    offload: str = "none"
    precision: str = "bf16"
    chunks: int = 1  # model chunks per pipeline rank (2: the interleaved schedule)
    software: Software = Software()

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def distributes_saved(self) -> bool:
        """Whether full recompute's kept inputs are split over tp (``Software.distribute_saved``;
        under sequence parallelism they are split already)."""
        k = self.software
        full = self.recompute == "full"
        return k.distribute_saved and not k.sequence_parallel and self.tp > 1 and full

    def layout(self) -> Layout:
        return Layout(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            stage=self.stage,
            precision=self.precision,
            optimizer="adam",
            offload_optimizer=self.offload,
        )

    def workload(self) -> Workload:
        return Workload(
            micro_batch=self.micro_batch,
            gas=self.gas,
            recompute=self.recompute,
            sequence_parallel=self.tp > 1 and self.software.sequence_parallel,
            flash=self.software.flash,
            fused_mlp=self.software.fused,
            distribute_saved=self.distributes_saved,
            in_flight=pipeline(self.pp, self.gas, self.chunks)[1],
        )


SIMULATED = 20_000  # instructions over all ranks up to which the schedule is simulated


@lru_cache(maxsize=512)
def pipeline(pp: int, gas: int, chunks: int = 1) -> tuple[float, float]:
    """``(bubble, in_flight)``: idle time as a share of a rank's compute, and the micro-batches
    (through all of a rank's layers) the first stage holds at its peak."""
    if pp == 1:
        return 0.0, 1.0
    if pp * 3 * gas * chunks <= SIMULATED:
        name = "interleaved" if chunks > 1 else "1f1b"
        r = simulate(build_streams(name, pp, gas, chunks), forward=1, backward=2, chunks=chunks)
        return r.makespan / (3 * gas) - 1, r.peak_activations[0] / chunks
    in_flight = min(pp, gas) * (1 + (pp - 1) / (pp * chunks)) if chunks > 1 else min(pp, gas)
    return (pp - 1) / (gas * chunks), in_flight


def model_flops(m: Transformer, batch: int, *, recompute: str = "none") -> float:
    """Flops of one training step of ``batch`` sequences (forward, backward, recompute):
    :func:`zerostack.profiling.flops.transformer_flops`, plus, for selective recompute, the
    attention core's 4 B s^2 l h forward once more."""
    total = transformer_flops(
        m.layers,
        m.hidden,
        m.heads,
        m.vocab,
        m.seq,
        batch,
        ffn=m.ffn_hidden,
        recompute=recompute == "full",
        kv_hidden=m.kv_hidden,
        gated=m.gated,
    )
    if recompute == "selective":
        total += 4 * batch * m.seq * m.seq * m.layers * m.hidden
    return total


CAUSAL = 0.5  # a causal mask leaves the fused attention kernel half the square to compute


def attention_core_flops(m: Transformer, batch: int, *, recompute: str = "none") -> float:
    """The attention core's share of :func:`model_flops`: 4 B s^2 l h a forward (Q K^T and the
    weighted sum of V, counted over the whole square as Narayanan et al. count it), three
    forwards' worth with backward, one more when recompute runs it again."""
    passes = 3 + (1 if recompute in ("full", "selective") else 0)
    return 4 * batch * m.seq * m.seq * m.hidden * m.layers * passes


def hbm_bytes(m: Transformer, batch: int, c: Candidate) -> float:
    """Bytes one rank moves through device memory in one step outside the matmuls, at an even
    share of the layers (the caller scales to the busiest stage): what the elementwise kernels
    read and write, counted per operation (``d`` bytes per element, dropout masks 1 byte).

    Per token and layer, forward: two norms (LayerNorm one kernel, 2 d; an eager RMSNorm
    upcasts, squares, averages, scales and casts back, 4 d + 28, fused 2 d); two residual
    additions (3 d), each behind a dropout when there is one (eager 2 d more; a mask byte);
    the MLP's activation over its width (GELU 2 d; SwiGLU eager 5 d, fused 3 d); rotary
    positions on Q and K (eager through fp32 complex numbers, 2 d + 16; fused 2 d); unless the
    attention is flash, its scores, a / t x s per token (written, softmaxed: fused 2 d,
    eager scale, mask and softmax 6 d; dropped out: 2 d and a mask byte; read), and the loss
    over the vocabulary (eager fp32 softmax and its gradient 2 d + 40, fused 2 d + 8, per
    token and vocabulary entry over t). Backward moves twice the forward's bytes; a recomputed
    forward moves them again (selective recompute: the scores only). Widths split over tp are
    divided by t; the norms and residuals only under sequence parallelism."""
    k, d, t = c.software, PRECISION_BYTES[c.precision], c.tp
    h, f, kv = m.hidden, m.ffn_hidden, m.kv_hidden
    whole = h / (t if k.sequence_parallel else 1)  # the replicated width under tp
    if m.gated:  # Llama-style: RMSNorm, SwiGLU
        norm = 2 * d if k.fused else 4 * d + 28
        act = (3 if k.fused else 5) * d * f / t
    else:
        norm, act = 2 * d, 2 * d * f / t
    dropout = ((0 if k.fused else 2 * d) + 1) if m.dropout else 0
    per_token = 2 * norm * whole + 2 * (3 * d + dropout) * whole + act
    if not m.positions:
        per_token += (2 * d if k.fused else 2 * d + 16) * (h + kv) / t
    forwards = 3 + (1 if c.recompute == "full" else 0)
    layer = per_token * forwards
    if not k.flash:
        score = (4 * d if k.fused else 8 * d) + ((2 * d + 1) if m.dropout else 0)
        layer += score * m.heads / t * m.seq * (3 + (c.recompute != "none"))
    tokens = batch * m.seq / c.dp
    return tokens * (layer * m.layers / c.pp + _loss_bytes(m, c) / c.pp)


def _loss_bytes(m: Transformer, c: Candidate) -> float:
    """HBM bytes per token of the loss over this tp rank's vocabulary (see :func:`hbm_bytes`)."""
    d = PRECISION_BYTES[c.precision]
    return (2 * d + (8 if c.software.fused else 40)) * m.vocab / c.tp


def matrix_chain(ratio: float, sizes: list[int]) -> float:
    """A phase's time over its compute when each matrix's gather, ``ratio`` times its compute,
    overlaps only the compute of the matrix before it, over a stack of layers whose matrices
    have ``sizes`` in the order they run: sum_j max(s_j, ratio s_(j+1)) / sum_j s_j (the last
    matrix's successor the next layer's first). 1 when every gather hides, ``ratio`` when the
    link never rests, more than both in between when the sizes differ."""
    n = len(sizes)
    return sum(max(sizes[j], ratio * sizes[(j + 1) % n]) for j in range(n)) / sum(sizes)


def pp_send_bytes(m: Transformer, c: Candidate) -> float:
    """Bytes one tp rank sends across a pipeline stage boundary per micro-batch and direction:
    an activation (or its gradient), 1/tp of it under sequence parallelism or Megatron's
    scatter/gather (:class:`Software`), whole otherwise."""
    k = c.software
    split = c.tp if k.sequence_parallel or k.scatter_gather else 1
    return c.micro_batch * m.seq * m.hidden * PRECISION_BYTES[c.precision] / split


def head_seconds(m: Transformer, batch: int, c: Candidate, hw: Hardware) -> float:
    """The output layer's share of :func:`compute_seconds` (its matmuls forward and backward,
    never recomputed, and the loss's bytes), at the same even share over every rank. A
    pipeline's last stage runs all of it: ``pp`` times this on each of its ranks."""
    matmul = hw.peak_flops * hw.kernel_derate * hw.matmul_efficiency
    flops = 6 * batch * m.seq * m.hidden * m.vocab
    loss = batch * m.seq / c.dp * _loss_bytes(m, c) / c.pp
    return flops / matmul / c.world + loss / (hw.hbm_bw * hw.kernel_derate)


def compute_seconds(m: Transformer, batch: int, c: Candidate, hw: Hardware) -> float:
    """Seconds one rank computes in one step at an even share of the layers: the matmuls at
    ``matmul_efficiency`` of peak, the attention core at ``attention_efficiency`` (flash, its
    causal half) or as matmuls (materialised scores), and :func:`hbm_bytes` at the device's
    memory bandwidth, each rate times ``kernel_derate``, one after another (a roofline per
    kernel: a transformer's kernels are each either compute or memory bound)."""
    rate = hw.peak_flops * hw.kernel_derate
    matmul = rate * hw.matmul_efficiency
    total = model_flops(m, batch, recompute=c.recompute)
    core = attention_core_flops(m, batch, recompute=c.recompute)
    if c.software.flash and hw.attention_efficiency:
        attention = core * CAUSAL / (rate * hw.attention_efficiency)
    else:
        attention = core / matmul
    memory = hbm_bytes(m, batch, c) / (hw.hbm_bw * hw.kernel_derate)
    return ((total - core) / matmul + attention) / c.world + memory


def _ring(nbytes: float, n: int, bw: float, latency: float, passes: int = 1) -> float:
    """Seconds of ``passes`` ring reduce-scatters / all-gathers of ``nbytes`` over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return passes * ((n - 1) / n * nbytes / bw + (n - 1) * latency)


def _link(hw: Hardware, span: int) -> tuple[float, float]:
    """Bandwidth and latency of a group whose ranks are ``span`` devices apart end to end."""
    if span <= hw.gpus_per_node:
        return hw.intra_bw * hw.link_efficiency, hw.intra_latency
    return hw.inter_bw * hw.link_efficiency, hw.inter_latency


@dataclass
class Prediction:
    candidate: Candidate
    step_s: float
    compute_s: float
    bubble_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    dp_exposed_s: float
    optimizer_s: float
    memory_bytes: float
    mfu: float
    hfu: float

    def as_dict(self) -> dict:
        out = asdict(self)
        out["candidate"] = asdict(self.candidate)
        return out


def stage3_fetch_units(layers: float) -> float:
    """The gathers stage 3 issues per forward (and again per backward): about one per layer,
    plus the embeddings, the final norm and the output layer. What the CommLog counts for the
    reference GPT of benchmarks/plan.py (7 per pass for 4 layers at the default persistence
    threshold); the exact number follows the prefetch buckets and which small parameters stay
    whole, so this is an approximation, not a rule."""
    return layers + 3


def tp_collectives(
    layers: float,
    recompute: str = "none",
    sequence_parallel: bool = True,
    vocab_parallel: bool = True,
) -> tuple[float, float]:
    """Collectives over the tp axis per micro-batch, forward and backward through ``layers``
    layers plus the embedding and the output layer: (activation-sized ring passes, small
    all-reduces). Under sequence parallelism the passes are all-gathers and reduce-scatters
    (the column layers gather their input again in backward) and the small all-reduces sum the
    gradients of the parameters every tp rank holds whole (norms, row-parallel biases), which
    each rank computed from its own part of the sequence. Without it, each layer all-reduces
    (two passes) twice in forward and twice in backward, and the whole parameters' gradients
    are equal on every tp rank already: only the loss's two small all-reduces remain, and none
    when the embedding and the output layer are whole on every tp rank (``vocab_parallel``
    False: a Hugging Face model under AutoTP, whose column layers reading one input all-reduce
    its gradient once). ``tests/test_tensor_parallel.py`` and ``tests/test_dryrun.py`` hold
    them to what the CommLog counts."""
    again = 1 if recompute == "full" else 0  # the recomputed forward's collectives
    if not sequence_parallel:
        ends = 2 if vocab_parallel else 0  # the embedding's all-reduce, the output layer's
        return 2 * (layers * (4 + 2 * again) + ends), ends
    return layers * (10 + 4 * again) + 5, layers * 6 + 4


@lru_cache(maxsize=4096)
def _rank_sizes(m: Transformer, tp: int, pp: int) -> tuple[int, ...]:
    """The parameter tensors of the pipeline stage holding the most (:meth:`Transformer.
    rank_tensors`)."""
    return tuple(max((m.rank_tensors(tp, pp, s) for s in range(pp)), key=sum))


PERSISTENCE = 100_000  # stage3_param_persistence_threshold's default: smaller ones stay whole


def dp_traffic(m: Transformer, c: Candidate, persistence: int = PERSISTENCE) -> dict[str, float]:
    """Bytes one step's data-parallel collectives carry, by kind, on the rank holding the most
    parameters, as zerostack's strategies issue them and its CommLog counts them (an
    all-gather's output, a reduce-scatter's input, in the compute dtype; the gradient norm's
    4-byte all-reduce apart): stage 0 all-reduces the gradients once; stage 1 reduce-scatters
    them and gathers the stepped pieces; stage 2 reduce-scatters every micro-batch; stage 3
    also gathers every parameter of at least ``persistence`` elements in forward and in
    backward (and, when :class:`Software` regathers, for a recomputed forward: each layer's but
    its last matrix, which backward finds still held), a tied output layer the embedding once
    more, and after the step the small parameters every rank keeps whole; every tensor padded
    to ``dp`` whole pieces (:func:`~zerostack.zero.partition.piece_numel`).
    ``tests/test_dryrun.py`` holds it to the engine's own collectives at 1,024 ranks. Bucket
    padding at stages 1-2 (under 8 x dp elements per bucket) is left out."""
    from ..zero.partition import piece_numel

    d = PRECISION_BYTES[c.precision]
    sizes = _rank_sizes(m, c.tp, c.pp)
    psi = sum(sizes)
    if c.dp == 1:
        return {}
    if c.stage == 0:
        return {"all_reduce": psi * d}
    if c.stage == 1:
        return {"reduce_scatter": psi * d, "all_gather": psi * d}
    if c.stage == 2:
        return {"reduce_scatter": c.gas * psi * d, "all_gather": psi * d}

    def padded(tensors) -> int:  # each parameter cut into dp pieces of whole 16-byte blocks
        return sum(piece_numel(n, c.dp) for n in tensors) * c.dp

    big = [n for n in sizes if n >= persistence]
    small = [n for n in sizes if n < persistence]
    gathers = 2 * padded(big)  # forward and backward
    if c.recompute == "full" and c.software.regather:
        # the recomputed forward gathers each layer again but its last matrix, which is still
        # held when that layer's backward starts
        layer = [n for n in m.layer_tensors(c.tp) if n >= persistence]
        gathers += max(m.stage_layers(c.pp)) * padded(layer[:-1])
    embedding = m.vocab * m.hidden // (c.tp if m.vocab_parallel else 1)
    if m.tied and c.pp == 1 and embedding >= persistence:
        gathers += padded([embedding])  # the output layer gathers the embedding once more
    all_gather = c.gas * gathers + padded(small)  # after the step: the kept parameters
    return {"all_gather": all_gather * d, "reduce_scatter": c.gas * padded(sizes) * d}


def memory_bytes(m: Transformer, c: Candidate) -> float:
    """Bytes one rank of ``c`` holds at its peak: :func:`~zerostack.estimate.estimate`'s (which
    describes zerostack's engine), with the habits of the software ``c`` runs on that differ:
    DeepSpeed's module-by-module stage 3 gathers (``prefetch="matrix"``) and Megatron 2021's
    fp32 gradient copy (``step_grad_copy``)."""
    d = PRECISION_BYTES[c.precision]
    work, largest = c.workload(), None
    if c.stage == 3 and c.software.prefetch == "matrix":
        # DeepSpeed gathers module by module: the matrix in use and the one prefetched next
        embedding = m.vocab * m.hidden // (c.tp if m.vocab_parallel else 1)
        largest = max(*m.layer_tensors(c.tp), embedding)
        work = replace(work, prefetch_bucket=largest)
    est = estimate(int(m.params), c.layout(), model=m, work=work, largest_layer=largest)
    memory = est["total_bytes_per_rank"]
    if c.software.step_grad_copy and d < 4:  # fp32 copies of the stepped gradients, after backward
        stepped = est["params_per_model_parallel_rank"] / (c.dp if c.stage else 1)
        memory += max(0.0, 4 * stepped - est["activation_bytes_per_rank"])
    return memory


def predict(m: Transformer, batch: int, c: Candidate, hw: Hardware) -> Prediction:
    """Seconds per step and bytes per rank of candidate ``c`` (see the module docstring)."""
    d = PRECISION_BYTES[c.precision]
    flops = model_flops(m, batch, recompute=c.recompute)
    # the busiest pipeline stage paces the step: more than layers / pp when they do not divide,
    # and the last stage runs the output layer and the loss besides its layers
    stages = m.stage_layers(c.pp)
    busiest = max(stages)
    head = head_seconds(m, batch, c, hw) * c.pp
    layer = (compute_seconds(m, batch, c, hw) - head / c.pp) * c.pp / m.layers
    compute = max(busiest * layer, stages[-1] * layer + head)
    backward = compute * 2 / (3 + (1 if c.recompute == "full" else 0))
    bubble = compute * pipeline(c.pp, c.gas, c.chunks)[0]
    if hw.shared_cores:  # idle ranks lend their cores: the machine's throughput bounds the step
        critical = (compute + bubble) * hw.shared_cores / c.world
        bubble = max(0.0, critical - compute)

    # tensor parallelism, per micro-batch (tp_collectives): under sequence parallelism per
    # layer an all-gather before and a reduce-scatter after attention and the MLP, in forward,
    # backward and a recomputed forward, the column layers' inputs gathered again in backward,
    # and an all-reduce of each replicated parameter's gradient (two LayerNorms, two
    # row-parallel biases); without it an all-reduce in each place instead; the embeddings and
    # the vocabulary-parallel loss add a few. All are on the critical path. Ranks tp apart are
    # adjacent (tp is the innermost axis of the grid).
    bw, lat = _link(hw, c.tp)
    act = c.micro_batch * m.seq * m.hidden * d
    big, small = tp_collectives(
        busiest, c.recompute, c.software.sequence_parallel, m.vocab_parallel
    )
    big += busiest if c.distributes_saved else 0  # backward gathers each kept input again
    per_micro = big * _ring(act, c.tp, bw, lat) + small * _ring(4 * m.hidden, c.tp, bw, lat, 2)
    tp_s = c.gas * per_micro if c.tp > 1 else 0.0

    # pipeline: stage boundaries are tp x dp devices apart; each of a rank's chunks sends an
    # activation forward and a gradient back per micro-batch (interleaving crosses more)
    bw, lat = _link(hw, c.tp * c.dp * 2)
    pp_s = 2 * c.gas * c.chunks * (pp_send_bytes(m, c) / bw + lat) if c.pp > 1 else 0.0

    # data parallelism: dp ranks are tp apart
    traffic = dp_traffic(m, c)
    psi = sum(_rank_sizes(m, c.tp, c.pp))
    bw, lat = _link(hw, c.tp * c.dp)
    # stages 1-3: the gradient norm's all-reduce over the shards (stage 0 has whole gradients)
    norm = _ring(4, c.dp, bw, lat, passes=2) if c.stage else 0.0
    # the gradients' reduction overlaps backward (the last micro-batch's, with accumulation)
    overlap = backward / c.gas if c.software.overlap_grad_reduce else 0.0
    if c.stage <= 1:  # one all-reduce (stage 1: a reduce-scatter and a gather, as many bytes)
        dp_s = _ring(traffic.get("all_reduce", traffic.get("reduce_scatter", 0)), c.dp, bw, lat, 2)
    elif c.stage == 2:  # a reduce-scatter per micro-batch, the stepped pieces gathered once
        dp_s = c.gas * _ring(traffic.get("reduce_scatter", 0) / c.gas, c.dp, bw, lat)
        dp_s += _ring(traffic.get("all_gather", 0), c.dp, bw, lat)
        overlap = backward if c.software.overlap_grad_reduce else 0.0
    else:
        # per micro-batch about one gather per layer (stage3_fetch_units) forward and backward,
        # one per layer for a recomputed forward, and the gradients reduced; prefetched and
        # asynchronous, so it overlaps compute where it can
        again = busiest if c.recompute == "full" and c.software.regather else 0  # recompute
        gathers = c.gas * (2 * stage3_fetch_units(busiest) + again)
        gather_s = _ring(traffic.get("all_gather", 0), c.dp, bw, 0.0) + gathers * (c.dp - 1) * lat
        reduce_s = c.gas * _ring(traffic.get("reduce_scatter", 0) / c.gas, c.dp, bw, lat)
        dp_s = gather_s + reduce_s
        overlap = compute
        if c.software.prefetch == "matrix":  # forward, then backward (and its recompute)
            passes = 3 if again else 2
            forward = compute / (4 if c.recompute == "full" else 3)
            phases = [
                (forward, gather_s / passes, 1),
                (compute - forward, gather_s * (passes - 1) / passes + reduce_s, -1),
            ]
            sizes = [n for n in m.layer_tensors(c.tp) if n >= PERSISTENCE]  # gathered ones
            took = sum(t * matrix_chain(g / t, sizes[::order]) for t, g, order in phases)
            overlap = dp_s - (took - compute)
    if hw.shared_cores:  # collectives run on the cores compute needs
        overlap = 0.0
    # compute beside a collective runs 1 + f times slower (Hardware.overlap_slowdown): over the
    # dp_s seconds the collectives take it does dp_s / (1 + f) of its work, so the step grows
    # by dp_s f / (1 + f), or by what the collectives outlast the compute when that is more
    slowed = hw.overlap_slowdown / (1 + hw.overlap_slowdown) if overlap > 0 else 1.0
    dp_exposed = max(dp_s - overlap, dp_s * slowed, 0.0) + norm  # the norm waits for the last

    shard = psi / (c.dp if c.stage > 0 else 1)
    if c.offload == "none":
        optimizer = shard * 16 / hw.device_adam_bytes_per_s  # read/write master + 2 moments
    else:
        optimizer = shard * (4 + d) / hw.host_bw + shard / hw.cpu_adam_params_per_s

    step = compute + bubble + tp_s + pp_s + dp_exposed + optimizer
    useful = model_flops(m, batch)
    return Prediction(
        candidate=c,
        step_s=step,
        compute_s=compute,
        bubble_s=bubble,
        tp_s=tp_s,
        pp_s=pp_s,
        dp_s=dp_s,
        dp_exposed_s=dp_exposed,
        optimizer_s=optimizer,
        memory_bytes=memory_bytes(m, c),
        mfu=useful / (step * c.world * hw.peak_flops),
        hfu=flops / (step * c.world * hw.peak_flops),
    )
