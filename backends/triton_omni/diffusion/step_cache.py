"""Step caching per request, inside step batching.

First Block Cache (diffusers' ``FirstBlockCache``, from ParaAttention): each
denoising step runs the DiT's first block; when that block's residual has
changed by at most ``threshold`` (mean absolute change over mean absolute
value) since the last step that ran every block, the other blocks are skipped
and the residual they added at that step is reused.

diffusers' hook keeps one state per cache context (the prompt's pass, the
negative's) and decides for the whole batch at once, so requests at different
steps sharing a forward pass would share one state. Here the state belongs to
each request's pass (``PassCache``) and each pass decides for its own rows:
the rows that compute go through the remaining blocks as a smaller batch,
the rows that reuse pass through them untouched. A request therefore makes
the decisions it makes alone, in any company.

Built on diffusers' hook registry and its table of what each block returns;
written here: the state per request and the split of a batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockRegistry

METHODS = ("first_block",)
DEFAULT_THRESHOLD = 0.05  # diffusers' FirstBlockCacheConfig default
HOOK = "triton_omni_step_cache"
UNBATCHED_ARGUMENTS = ("image_rotary_emb",)  # a block argument shared by every row, whatever its first dim


@dataclass(frozen=True)
class StepCacheConfig:
    method: str = "off"
    threshold: float = DEFAULT_THRESHOLD

    @property
    def on(self) -> bool:
        return self.method != "off"

    def __str__(self) -> str:
        return self.method if not self.on else f"{self.method}:{self.threshold:g}"


def parse_step_cache(text: str) -> StepCacheConfig:
    """``off``, ``first_block`` (the default threshold) or ``first_block:THRESHOLD``;
    ValueError says what is wrong (the caller names the value)."""
    method, colon, threshold = text.strip().partition(":")
    if method not in ("off", *METHODS):
        raise ValueError(f"the method must be one of {['off', *METHODS]}, as METHOD or METHOD:THRESHOLD")
    if method == "off":
        if colon:
            raise ValueError("'off' takes no threshold")
        return StepCacheConfig()
    try:
        value = float(threshold) if colon else DEFAULT_THRESHOLD
    except ValueError:
        raise ValueError("the threshold must be a number") from None
    if not 0.0 < value <= 1.0:
        raise ValueError("the threshold must be in (0, 1]")
    return StepCacheConfig(method, value)


class PassCache:
    """What First Block Cache keeps between the steps of one request's pass
    (its prompt's, or its negative's where the family runs them apart)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.head_residual: torch.Tensor | None = None  # the first block's, at the last step computed
        self.head_output: tuple | None = None  # (hidden, encoder hidden) after the first block, that step
        self.tail_residuals: tuple | None = None  # what the other blocks added, that step
        self.computed = True  # whether this step ran every block


class FirstBlockCache:
    """Hooks on a DiT's blocks; ``passes(rows)`` around a forward pass says whose each row is."""

    def __init__(self, transformer: torch.nn.Module):
        blocks = [block for name, child in transformer.named_children()
                  if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
                  for block in child]
        if len(blocks) < 2:
            raise ValueError(f"{type(transformer).__name__} has no transformer blocks First Block Cache can skip")
        self.rows: list[PassCache | None] | None = None  # this forward pass's rows' owners
        self.compute: list[int] | None = None  # the rows running the remaining blocks (None: all)
        # around a block run by those rows alone: what else follows a pass's rows follows them (LoRA's)
        self.narrow: Callable[[torch.Tensor], contextlib.AbstractContextManager] = \
            lambda rows: contextlib.nullcontext()
        for index, block in enumerate(blocks):
            metadata = TransformerBlockRegistry.get(type(block))
            hook = _HeadHook(self, metadata) if index == 0 else \
                _BlockHook(self, metadata, tail=index == len(blocks) - 1)
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, HOOK)

    @contextlib.contextmanager
    def passes(self, rows: list[PassCache | None]) -> Iterator[None]:
        """A forward pass whose row ``i`` belongs to ``rows[i]`` (None: a row that always computes,
        as an uncached request's or a padding row)."""
        self.rows = rows if any(row is not None for row in rows) else None
        try:
            yield
        finally:
            self.rows, self.compute = None, None

    def owners(self) -> list[tuple[PassCache, list[int]]]:
        """Each pass of this forward with its rows, in the order the rows come."""
        grouped: dict[int, tuple[PassCache, list[int]]] = {}
        for row, owner in enumerate(self.rows or ()):
            if owner is not None:
                grouped.setdefault(id(owner), (owner, []))[1].append(row)
        return list(grouped.values())


def _outputs(output, metadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden states, encoder hidden states or None) of a block's output."""
    if not isinstance(output, tuple):
        return output, None
    encoder = metadata.return_encoder_hidden_states_index
    return output[metadata.return_hidden_states_index], None if encoder is None else output[encoder]


def _as_output(hidden: torch.Tensor, encoder: torch.Tensor | None, metadata):
    """A block's output from its parts, in the order the block returns them."""
    if metadata.return_encoder_hidden_states_index is None:
        return hidden
    output = [None, None]
    output[metadata.return_hidden_states_index] = hidden
    output[metadata.return_encoder_hidden_states_index] = encoder
    return tuple(output)


def _inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's (hidden states, encoder hidden states or None): by name, or its first argument
    (Z-Image's blocks call the hidden states ``x``, positionally)."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return hidden, kwargs.get("encoder_hidden_states")


def _rows_of(value, rows: torch.Tensor, batch: int):
    return value.index_select(0, rows) if isinstance(value, torch.Tensor) and value.dim() and \
        value.shape[0] == batch else value


class _HeadHook(ModelHook):
    """The first block: runs for every row, then each pass decides whether its rows compute the rest."""

    def __init__(self, cache: FirstBlockCache, metadata):
        super().__init__()
        self.cache, self.metadata = cache, metadata

    def new_forward(self, module, *args, **kwargs):
        output = self.fn_ref.original_forward(*args, **kwargs)
        cache = self.cache
        if cache.rows is None:
            cache.compute = None
            return output
        hidden_in, _ = _inputs(args, kwargs)
        hidden, encoder = _outputs(output, self.metadata)
        residual = hidden - hidden_in
        owners = cache.owners()
        # every pass's change, read back at once (a wait for the device per forward, not per request)
        changes = [(residual[rows] - owner.head_residual).abs().mean() / owner.head_residual.abs().mean()
                   for owner, rows in owners if owner.head_residual is not None]
        change = iter(torch.stack(changes).tolist() if changes else ())
        skipped: set[int] = set()
        for owner, rows in owners:
            owner.computed = owner.head_residual is None or next(change) > owner.threshold
            if owner.computed:
                owner.head_residual = residual[rows]
                owner.head_output = (hidden[rows], None if encoder is None else encoder[rows])
                continue
            skipped.update(rows)
            hidden[rows] = owner.tail_residuals[0] + hidden[rows]
            if encoder is not None:
                encoder[rows] = owner.tail_residuals[1] + encoder[rows]
        cache.compute = None if not skipped else [row for row in range(hidden.shape[0]) if row not in skipped]
        return output


class _BlockHook(_HeadHook):
    """Every other block: runs for the rows that compute (a smaller batch), passes the others
    through; the last block also keeps each computing pass's residual of them all."""

    def __init__(self, cache: FirstBlockCache, metadata, tail: bool):
        super().__init__(cache, metadata)
        self.tail = tail

    def new_forward(self, module, *args, **kwargs):
        cache, metadata = self.cache, self.metadata
        compute = cache.compute
        if compute is None:
            output = self.fn_ref.original_forward(*args, **kwargs)
        elif not compute:  # every row reuses: the block is not run (as diffusers' hook does)
            return _as_output(*_inputs(args, kwargs), metadata)
        else:
            hidden_in, encoder_in = _inputs(args, kwargs)
            batch, rows = hidden_in.shape[0], torch.tensor(compute, device=hidden_in.device)
            with cache.narrow(rows):
                part = self.fn_ref.original_forward(
                    *(_rows_of(a, rows, batch) for a in args),
                    **{k: v if k in UNBATCHED_ARGUMENTS else _rows_of(v, rows, batch) for k, v in kwargs.items()})
            hidden_part, encoder_part = _outputs(part, metadata)
            hidden = hidden_in.index_copy(0, rows, hidden_part)
            encoder = None if encoder_in is None else encoder_in.index_copy(0, rows, encoder_part)
            output = _as_output(hidden, encoder, metadata)
        if self.tail and cache.rows is not None:
            hidden, encoder = _outputs(output, metadata)
            for owner, owner_rows in cache.owners():
                if owner.computed:
                    owner.tail_residuals = _residuals(hidden[owner_rows], None if encoder is None else
                                                      encoder[owner_rows], *owner.head_output)
        return output


def _residuals(hidden: torch.Tensor, encoder: torch.Tensor | None, head_hidden: torch.Tensor,
               head_encoder: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the blocks after the first added to (the image stream, the text stream). Where the
    last block returns the two streams joined, text first (FLUX's single-stream blocks, which its
    transformer feeds with their concatenation), the joined residual is split back into the two,
    so that a skipped step adds each to its stream after the first block and the transformer's own
    concatenation gives the joined output the blocks would have."""
    if encoder is None and head_encoder is not None and hidden.shape[1] == head_encoder.shape[1] + \
            head_hidden.shape[1]:
        text = head_encoder.shape[1]
        return hidden[:, text:] - head_hidden, hidden[:, :text] - head_encoder
    return hidden - head_hidden, None if encoder is None else encoder - head_encoder
