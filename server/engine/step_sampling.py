"""One token for every row of a step that ends a prompt or decodes, from the logits where the graph left them.

Three paths, cheapest first:
- every row greedy and asking no logprobs: each row's maximum ([rows] ids leave the device);
- otherwise the compiled sampling graph of the row bucket, for all rows at once (ids, the sampled token's
  logprob and the top-20 logprobs leave the device, never [rows, vocab] floats);
- on the host, row by row, for what the graph does not do: repetition / presence / frequency penalties (they
  need the request's token counts) and rows the graph flags (a top-k past its candidates, a nucleus wider than
  them). `scripts/bench_sampling.py` measures the first and the last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from buckets.scheduler import MixedStep, Sequence
from buckets.speculation import accepted
from models import native
from models.runner import ModelRunner
from models.sampling import SampledToken, Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLogits:
    logits: torch.Tensor  # [R, V] on the device, R the step's row bucket
    rows: list[int]  # row of logits for each sampling sequence of the step, in order
    drafts: torch.Tensor | None = None  # a verify step: [D, V] at each draft token (the decoding rows' drafts, in order)


def _needs_host(sampler: Sampler) -> bool:
    return sampler.params.has_penalties


def _needs_graph(sampler: Sampler) -> bool:
    p = sampler.params
    return not p.is_greedy or p.logprobs is not None


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """logits [rows, V] -> each row's argmax (the first maximum on ties; a row with a NaN gives its first NaN), for
    every row of the bucket (pad rows too: no index tensor, no copy of the logits). On the CPU by the native
    kernel (models/csrc/argmax.c: ~1.7 ms less for a 64-token verify step's logits); elsewhere by max's indices,
    which PyTorch documents as argmax's, because CPU argmax on bf16 is ~5x slower than max here."""
    ids = native.argmax(logits)
    if ids is None:
        ids = logits.max(dim=-1).indices.tolist()
    return ids


def sample_step(runner: ModelRunner, seqs: tuple[Sequence, ...], samplers: list[Sampler | None], out: StepLogits
                ) -> list[SampledToken | Exception | None]:
    results: list[SampledToken | Exception | None] = [None] * len(seqs)
    live = [(i, s) for i, s in enumerate(samplers) if s is not None]
    on_device = [(i, s) for i, s in live if not _needs_host(s)]
    host = [(i, s) for i, s in live if _needs_host(s)]
    graph: list[tuple[int, Sampler]] = []
    plain: list[tuple[int, Sampler]] = []
    for i, s in on_device:
        (graph if _needs_graph(s) else plain).append((i, s))
    if graph:
        logits, at = _graph_rows(runner, out, [out.rows[i] for i, _ in graph])
        rows: list[tuple[float, int, float, float, int, int] | None] = [None] * logits.shape[0]
        for (i, s), r in zip(graph, at):
            p, seq = s.params, seqs[i]
            rows[r] = (p.temperature, p.top_k, p.top_p, p.min_p, s.seed, seq.prompt_len + seq.num_generated)
        try:
            ids, chosen, top_ids, top_lp, on_host = (t.cpu() for t in runner.sample(logits, rows))
        except Exception:  # noqa: BLE001 - one batch for every row: each row is sampled alone instead
            # A failure of the whole batch (one row's parameters the graph cannot take, an error in the graph)
            # must not fail the other requests of the step: the host path samples each row by itself, so only a
            # row that fails there too fails its request (its seeded draws then come from the host's generator).
            log.warning("the sampling graph failed; sampling the step's %d rows on the host", len(graph),
                        exc_info=True)
            host.extend(graph)
            graph = []
        else:
            for (i, s), r in zip(graph, at):
                if bool(on_host[r]):
                    host.append((i, s))
                    continue
                k = s.params.logprobs
                top = tuple(zip(top_ids[r, :k].tolist(), top_lp[r, :k].tolist())) if k else ()
                results[i] = SampledToken(int(ids[r]), float(chosen[r]) if k is not None else None, top)
    if plain:
        greedy = greedy_ids(out.logits)
        for i, _ in plain:
            results[i] = SampledToken(int(greedy[out.rows[i]]), None, ())
    for i, s in host:
        try:
            results[i] = s.sample(out.logits[out.rows[i]])
        except Exception as exc:  # noqa: BLE001 - one request's failure is that request's alone
            results[i] = exc
    return results


def _graph_rows(runner: ModelRunner, out: StepLogits, wanted: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The logits the sampling graph runs on and where each wanted row of out.logits sits in them. On the CPU,
    only the wanted rows, gathered into the smallest sampling bucket that holds them (a mixed step's 16 rows of
    logits cost the graph 10.5 ms, one sampled request's row alone 0.8 ms); pad rows repeat the first. Elsewhere
    the step's logits as they are: an eager gather there would compile."""
    if out.logits.device.type != "cpu":
        return out.logits, wanted
    bucket = min(b for b in runner.table.sample_batch_sizes if b >= len(wanted))
    index = torch.tensor(wanted + [wanted[0]] * (bucket - len(wanted)))
    return out.logits.index_select(0, index), list(range(len(wanted)))


@dataclass(frozen=True)
class Verified:
    tokens: list[int]  # what the row yields: its first token, then one per accepted draft
    drafts: int  # drafts it carried


def verify_drafts(step: MixedStep, tokens: list[SampledToken | Exception | None], out: StepLogits
                  ) -> dict[str, Verified]:
    """A verify step: the tokens each decoding row with drafts yields (its sampled first token, then the greedy
    tokens at the drafts the previous one confirmed), by request id. Only greedy rows carry drafts."""
    if out.drafts is None or not step.drafts:
        return {}
    predicted = greedy_ids(out.drafts)  # [D]: the prediction at each draft token, rows in decode order
    result: dict[str, Verified] = {}
    at = 0
    for seq, drafts, first in zip(step.decode, step.drafts, tokens):  # sampling rows begin with the decode rows
        if drafts and isinstance(first, SampledToken):
            result[seq.request_id] = Verified(accepted(first.token_id, drafts, predicted[at : at + len(drafts)]),
                                              len(drafts))
        at += len(drafts)
    return result
