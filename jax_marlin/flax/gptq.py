"""GPTQ for Flax NNX models, block by block: every ``nnx.Linear`` of each block becomes a ``MarlinLinear``.

    from jax_marlin.flax.gptq import gptq_blocks

    x = model.embed(calibration_tokens)                    # [batch, seq, hidden]: the first block's input
    gptq_blocks(model.layers, x, run_block=lambda block, x: block(x)[0], group_size=128)

Each block is quantized on the inputs it gets from the blocks before it,
already quantized, so later blocks learn to live with the earlier blocks'
errors: one forward pass of the float block collects the inputs of each of
its projections (as ``H = 2 X^T X / m``, :func:`jax_marlin.gptq.hessian`),
each projection is quantized with :func:`jax_marlin.gptq.quantize` and
replaced by a :class:`~jax_marlin.flax.MarlinLinear`, and a forward pass of
the quantized block gives the next block's inputs.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, MutableSequence, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_marlin import gptq
from jax_marlin.flax.nnx import MarlinLinear

__all__ = ["gptq_blocks"]


class _Recorder(nnx.Module):
    """Stands in for an ``nnx.Linear`` while a block runs: adds its inputs to a Hessian."""

    def __init__(self, linear: nnx.Linear, calls: list):
        self.linear = linear
        self.h = None
        self.count = 0
        self.calls = calls  # shared by a block's recorders: (recorder, input) of first calls

    def __call__(self, x):
        if self.count == 0:
            self.calls.append((self, x))
        h, self.count = gptq.hessian(x, self.h, self.count)
        self.h = nnx.data(h)
        return self.linear(x)


def _parent_and_key(root, path):
    node = root
    for key in path[:-1]:
        node = node[key] if isinstance(node, (MutableSequence, MutableMapping)) else getattr(node, key)
    return node, path[-1]


def _replace(root, path, new):
    parent, key = _parent_and_key(root, path)
    if isinstance(parent, (MutableSequence, MutableMapping)):
        parent[key] = new
    else:
        setattr(parent, key, new)


def _progress(total: int, progress: bool | None):
    """A tqdm bar over blocks; ``None`` (the default) shows it only on a terminal."""
    if progress is False:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError("gptq_blocks(progress=True) needs tqdm: pip install tqdm") from None
        return None
    return tqdm(total=total, desc="gptq", unit="block", disable=None if progress is None else False)


def gptq_blocks(
    blocks: Sequence[nnx.Module],
    inputs: jax.Array,
    *,
    run_block: Callable[[nnx.Module, jax.Array], jax.Array],
    group_size: int = 128,
    act_order: bool = False,
    damp: float = 0.01,
    min_clip: float = 1.0,
    refits: int = 0,
    zero_points: bool = False,
    sequential: bool = False,
    batch_size: int = 8,
    filter: Callable[[tuple[Any, ...], nnx.Linear], bool] | None = None,
    progress: bool | None = None,
) -> jax.Array:
    """Quantizes every ``nnx.Linear`` in ``blocks`` with GPTQ, in place, block after block.

    Args:
      blocks: the model's blocks in the order they run (e.g. ``model.layers``).
      inputs: ``[batch, ...]``, the calibration input of the first block.
      run_block: ``run_block(block, x) -> y``, one block's forward pass; ``y``
        is the next block's input (same shape as ``x``).
      group_size, act_order, damp, min_clip, refits, zero_points: as
        :func:`jax_marlin.gptq.quantize`.
      sequential: quantize a block's projections in stages: those that read
        the same input (q, k and v; gate and up) together, in the order the
        block calls them, each stage on the inputs the stages quantized before
        it produce. ``False``: all of a block's projections on the float
        block's inputs, from one forward pass.
      batch_size: calibration sequences per forward pass (bounds memory).
      filter: ``filter(path, linear) -> bool`` picks the projections to
        quantize (``path`` inside the block); ``None`` picks all. Subclasses
        of ``nnx.Linear`` are left alone, as in ``quantize_model``.
      progress: a tqdm bar over the blocks; ``None``: only on a terminal.

    Returns:
      The output of the last (quantized) block for ``inputs``.

    The scales are float16 or bfloat16 by the layer's dtypes, as
    ``quantize_model`` picks them (``jax_marlin.flax.matmul_dtype``).
    """
    if inputs.shape[0] == 0:
        raise ValueError(f"inputs of shape {inputs.shape} hold no calibration sequence")
    if batch_size <= 0:
        raise ValueError(f"batch_size = {batch_size} must be positive")

    def run_all(block, x):
        outs = [run_block(block, x[i:i + batch_size]) for i in range(0, x.shape[0], batch_size)]
        return jnp.concatenate(outs, axis=0)

    def record(block, x, linears):
        """Runs ``block`` on ``x`` with ``linears`` recording -> their recorders, in call order."""
        calls = []
        recorders = [(path, _Recorder(linear, calls)) for path, linear in linears]
        for path, recorder in recorders:
            _replace(block, path, recorder)
        try:
            run_all(block, x)
        finally:
            for path, recorder in recorders:
                _replace(block, path, recorder.linear)
        order = {id(recorder): i for i, (recorder, _) in enumerate(calls)}
        for path, recorder in recorders:
            if id(recorder) not in order:
                raise ValueError(f"run_block never called the linear layer at {path}")
        return sorted(recorders, key=lambda pr: order[id(pr[1])]), calls

    def stages_of(recorders, calls):
        """Groups of the recorders that read the same input array, in call order."""
        groups = []
        for path_recorder, (_, x) in zip(recorders, calls):
            if groups and x is groups[-1][0]:
                groups[-1][1].append(path_recorder)
            else:
                groups.append((x, [path_recorder]))
        return [group for _, group in groups]

    bar = _progress(len(blocks), progress)
    x = inputs
    try:
        for block in blocks:
            linears = [(path, node) for path, node in nnx.iter_graph(block)
                       if type(node) is nnx.Linear and (filter is None or filter(path, node))]
            recorders, calls = record(block, x, linears)
            stages = stages_of(recorders, calls) if sequential else [recorders]
            for i, stage in enumerate(stages):
                if i > 0:  # the inputs as the stages quantized before change them
                    stage, _ = record(block, x, [(path, r.linear) for path, r in stage])
                for path, recorder in stage:
                    linear = recorder.linear
                    layer = MarlinLinear.from_linear(linear, group_size=group_size)
                    layer.weight.set_value(gptq.quantize(
                        linear.kernel[...], recorder.h, group_size=group_size,
                        act_order=act_order, damp=damp, min_clip=min_clip, refits=refits,
                        zero_points=zero_points, dtype=layer.weight.get_value().dtype))
                    _replace(block, path, layer)
            x = run_all(block, x)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return x
