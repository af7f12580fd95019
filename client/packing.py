"""What each training stack takes from a batch with boundaries (FeederDataset(boundaries=True),
or packing="best_fit"): Hugging Face's packed inputs, Megatron-LM's masks for its three flags,
and a block-diagonal causal mask for SDPA. docs/packing.md shows each in use.

Every helper reads the batch's compact boundaries (`batch.boundaries`: the document starts
inside each sample, and where a bin's padding begins); a batch without them is refused, as
documents cannot be told apart in general from its tokens (a Hugging Face row or an MDS sample
gets its EOS from the feeder, a window may start inside a document).

A context-parallel member's batch (FeederDataset(cp_size=C > 1)) holds only its windows of each
sample, but the whole sample's boundaries: each helper gives the member's slice of what it gives
for the whole sample, at the member's input positions (its zigzag or contiguous chunks), as
Megatron's get_batch_on_this_cp_rank slices a whole batch: tokens, labels, loss_mask and
position_ids at those positions, and an attention mask's query rows there over every key of the
sample (ring attention brings every key to each member). `whole_sample=True` gives a mask or
segment ids over the whole sample (Ulysses: after its all-to-all, attention sees every position).
hf_inputs(whole=True) needs tokens a member does not hold, and is refused."""
from __future__ import annotations

import numpy as np
import torch

from feeder.core import context
from feeder.core.errors import Code, FeederError
from feeder.core.layout import label_crosses

from .decode import FeederBatch

IGNORE = -100   # what Hugging Face's and torch's cross entropy leave out


def _bounds(batch: FeederBatch):
    if batch.boundaries is None:
        raise FeederError("this batch carries no boundaries: open the stream with boundaries=True (or "
                          'packing="best_fit")', code=Code.FAILED_PRECONDITION)
    return batch.boundaries


def _at(batch: FeederBatch) -> np.ndarray:
    """int64: the input positions of the sample the batch holds (all of them, or a context-parallel
    member's)."""
    if batch.cp is None:
        return np.arange(batch.seq_len, dtype=np.int64)
    return context.positions(*batch.cp)


def hf_inputs(batch: FeederBatch, *, whole: bool = False) -> dict[str, torch.Tensor]:
    """A Hugging Face causal LM's packed inputs, as DataCollatorWithFlattening makes them:
    input_ids, position_ids restarting at each document (which transformers turns into a
    per-document mask under FlashAttention or SDPA, but only without a KV cache: call the model
    with use_cache=False), and labels aligned with the inputs (the
    model shifts them) with -100 at each segment's first token, so no token is predicted across
    documents (nor any padding).

    Inputs are tokens[:, :-1]; with whole=True all seq_len + 1 tokens, so that the model's own
    shift predicts exactly the sample's seq_len labels (the integrations' default, batch_dict).
    `shift_labels` (not with whole) are the already shifted targets of every input
    (tokens[:, 1:], -100 where a label crosses into another segment or is padding), for models
    that take them (transformers >= 4.50).

    A context-parallel member's: each at its positions of the sample; train on shift_labels (the
    model's own shift of `labels` would pair the last input of one of its windows with the first
    of the next). whole=True is refused (FeederError): the member holds 1/cp_size of the tokens."""
    b = _bounds(batch)
    sample_len = batch.seq_len + 1
    seg_start, mark = b.segments(sample_len)
    pad = np.arange(sample_len) >= b.lengths[:, None]
    first = mark | pad
    first[:, 0] = True                   # (no label: nothing before it in the sample)
    positions = np.arange(sample_len) - seg_start
    if batch.cp is not None:
        if whole:
            seq_len, cp_size, cp_rank, layout = batch.cp
            raise FeederError(f"hf_inputs(whole=True) needs all {sample_len} tokens of each sample, and this "
                              f"context-parallel member (cp_rank {cp_rank} of {cp_size}, {layout}) holds only its "
                              "windows: call hf_inputs(batch) and train on its shift_labels",
                              code=Code.FAILED_PRECONDITION)
        at = _at(batch)
        return {"input_ids": batch.input_ids, "position_ids": torch.from_numpy(positions[:, at]),
                "labels": batch.input_ids.masked_fill(torch.from_numpy(first[:, at]), IGNORE),
                "shift_labels": batch.labels.masked_fill(torch.from_numpy(first[:, at + 1]), IGNORE)}
    labels = batch.tokens.masked_fill(torch.from_numpy(first), IGNORE)
    positions = torch.from_numpy(positions)
    if whole:
        return {"input_ids": batch.tokens, "position_ids": positions, "labels": labels}
    return {"input_ids": batch.tokens[:, :-1], "position_ids": positions[:, :-1], "labels": labels[:, :-1],
            "shift_labels": labels[:, 1:]}


def megatron_inputs(batch: FeederBatch, *, eod_token: int, reset_position_ids: bool = False,
                    reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> dict[str, torch.Tensor]:
    """Megatron-LM's get_batch: tokens, labels, loss_mask, attention_mask, position_ids, as
    megatron.core.datasets.utils get_ltor_masks_and_position_ids makes them under its three
    flags, from the served boundaries instead of a scan for EOD (which a format may not store):

    * reset_position_ids: positions restart at each document (else 0..seq_len-1);
    * reset_attention_mask: a token attends only within its document (else causal);
    * eod_mask_loss: no loss where the input is the EOD token (Megatron's rule).

    attention_mask is Megatron's: bool [n, 1, seq_len, seq_len], True where attention is
    masked OUT. loss_mask is float32 [n, seq_len], 0 on a bin's padding whatever the flags.
    A context-parallel member's: what get_batch_on_this_cp_rank makes of the whole batch's,
    [n, seq_len / cp_size] and attention_mask [n, 1, seq_len / cp_size, seq_len]."""
    _bounds(batch)
    seq_len, at = batch.seq_len, _at(batch)
    tokens, labels = batch.input_ids, batch.labels
    loss_mask = batch.loss_mask.clone()
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = batch.position_ids if reset_position_ids else \
        torch.from_numpy(at).expand(len(tokens), len(at)).contiguous()
    allowed = block_causal_mask(batch) if reset_attention_mask else \
        _causal(at, seq_len).expand(len(tokens), 1, len(at), seq_len)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "attention_mask": ~allowed,
            "position_ids": position_ids}


def model_inputs(batch: FeederBatch) -> dict[str, torch.Tensor]:
    """What trainer/model.py's DecoderLM takes besides the tokens, for documents kept apart:
    position_ids restarting at each document, Megatron's attention_mask (True: masked out)
    within documents, and loss_mask 0 where a label lies across documents or is padding
    (a context-parallel member's: at its positions, as megatron_inputs)."""
    b = _bounds(batch)
    crosses = torch.from_numpy(label_crosses(b, batch.seq_len)[:, _at(batch)])
    return {"position_ids": batch.position_ids, "attention_mask": ~block_causal_mask(batch),
            "loss_mask": (~crosses).to(torch.float32)}


def segment_ids(batch: FeederBatch, *, whole_sample: bool = False) -> torch.Tensor:
    """int64 [n, seq_len]: which segment of its sample each input belongs to (0, 1, ...: the
    documents inside it, and a bin's padding), as torchtitan and Grain serve `segment_ids`.
    A context-parallel member's: [n, seq_len / cp_size] at its positions (whole_sample=True: of
    every input of the sample)."""
    seg = _segments(batch)
    return torch.from_numpy(seg if whole_sample or batch.cp is None else seg[:, _at(batch)])


def block_causal_mask(batch: FeederBatch, *, whole_sample: bool = False) -> torch.Tensor:
    """bool [n, 1, seq_len, seq_len], True where query i may attend key j: j <= i inside the
    same document (torch's scaled_dot_product_attention takes it as attn_mask; transformers
    takes it as a 4D attention_mask under attn_implementation="sdpa"). A context-parallel
    member's: [n, 1, seq_len / cp_size, seq_len], the rows of its query positions over every key
    of the sample (whole_sample=True: every row)."""
    seg = torch.from_numpy(_segments(batch))
    seq_len = seg.shape[1]
    at = np.arange(seq_len, dtype=np.int64) if whole_sample else _at(batch)
    rows = seg[:, torch.from_numpy(at)]
    same = rows[:, :, None] == seg[:, None, :]
    return (same & _causal(at, seq_len))[:, None]


def _segments(batch: FeederBatch) -> np.ndarray:
    """int64 [n, seq_len]: segment_ids over every input of the sample."""
    _, mark = _bounds(batch).segments(batch.seq_len + 1)
    return np.cumsum(mark[:, :-1], axis=1)


def _causal(at: np.ndarray, seq_len: int) -> torch.Tensor:
    """bool [len(at), seq_len]: key j at or before query position at[i]."""
    return torch.from_numpy(np.arange(seq_len)[None, :] <= at[:, None])
