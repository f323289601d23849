"""The sampling graph (run eagerly here): distributions, restrictions, seeds independent of the batch."""

from __future__ import annotations

import torch

from models.sample_graph import CANDIDATES, SampleInputs, hash_uniform, sample_rows


def run(logits: torch.Tensor, rows: list[tuple[float, int, float, float, int, int]]) -> list[int]:
    p = SampleInputs.allocate(logits.shape[0], "cpu")
    p.fill(rows)
    ids, *_ = sample_rows(logits, p)
    return ids.tolist()


def test_hash_is_uniform_and_depends_on_every_input() -> None:
    token = torch.arange(20000).view(1, -1)
    u = hash_uniform(torch.tensor([[7]]), torch.tensor([[3]]), token)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float((u < 0.1).float().mean()) - 0.1) < 0.01
    assert not torch.equal(u, hash_uniform(torch.tensor([[8]]), torch.tensor([[3]]), token))
    assert not torch.equal(u, hash_uniform(torch.tensor([[7]]), torch.tensor([[4]]), token))


def test_hash_fills_every_bin_and_neighbours_are_uncorrelated() -> None:
    """16 equal bins each hold 1/16 of 49152 tokens' draws (within 4%); the draws of a token at neighbouring
    positions, or of neighbouring seeds, do not follow each other; large seeds and positions stay in (0, 1)."""
    token = torch.arange(49152).view(1, -1)
    u = hash_uniform(torch.tensor([[123456]]), torch.tensor([[77]]), token)
    counts = torch.bincount((u * 16).long().view(-1), minlength=16).float() / token.numel()
    assert float((counts - 1 / 16).abs().max()) < 0.04 / 16
    for other in (hash_uniform(torch.tensor([[123456]]), torch.tensor([[78]]), token),
                  hash_uniform(torch.tensor([[123457]]), torch.tensor([[77]]), token)):
        assert abs(float(torch.corrcoef(torch.stack([u.view(-1), other.view(-1)]))[0, 1])) < 0.02
    top = hash_uniform(torch.tensor([[2**31 - 2]]), torch.tensor([[2**31 - 1]]), token)
    assert 0 < float(top.min()) and float(top.max()) < 1


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([1.0, 2.0, 0.0, -1.0, 0.5])
    want = torch.softmax(logits, -1)
    n = 4000
    draws = run(logits.expand(n, 5).contiguous(), [(1.0, 0, 1.0, 0.0, 11, pos) for pos in range(n)])
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / n
    assert torch.allclose(freq, want, atol=0.03), (freq, want)


def test_greedy_top_k_top_p_min_p_restrict_the_choice() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0, 1.0])
    n = 300
    wide = logits.expand(n, 5).contiguous()
    assert set(run(wide, [(0.0, 0, 1.0, 0.0, s, 0) for s in range(n)])) == {1}  # greedy
    assert set(run(wide, [(1.0, 2, 1.0, 0.0, s, 0) for s in range(n)])) == {1, 2}  # top-k 2
    assert set(run(wide, [(1.0, 0, 0.01, 0.0, s, 0) for s in range(n)])) == {1}  # nucleus of one
    assert set(run(wide, [(1.0, 0, 1.0, 0.5, s, 0) for s in range(n)])) == {1, 2}  # min-p
    assert set(run(wide, [(1.0, 0, 1.0, 0.0, s, 0) for s in range(n)])) >= {1, 2, 4}


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen)
    rows = [(0.8, 0, 0.9, 0.0, 100 + i, 40 + i) for i in range(6)]
    together = run(logits, rows)
    alone = [run(logits[i : i + 1], [rows[i]])[0] for i in range(6)]
    shuffled = run(logits[[5, 4, 3, 2, 1, 0]], rows[::-1])
    assert together == alone == shuffled[::-1]


def test_rows_the_graph_cannot_sample_exactly_are_flagged_for_the_host() -> None:
    logits = torch.zeros(3, 2 * CANDIDATES)  # flat: a nucleus of 0.9 needs more than the candidates
    p = SampleInputs.allocate(3, "cpu")
    p.fill([(1.0, CANDIDATES + 1, 1.0, 0.0, 1, 0), (1.0, 0, 0.9, 0.0, 1, 0), (1.0, 5, 1.0, 0.0, 1, 0)])
    *_, on_host = sample_rows(logits, p)
    assert on_host.tolist() == [True, True, False]


def test_logprobs_are_of_the_unscaled_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    p = SampleInputs.allocate(1, "cpu")
    p.fill([(0.0, 0, 1.0, 0.0, 0, 0)])
    ids, chosen, top_ids, top_lp, _ = sample_rows(logits, p)
    logp = torch.log_softmax(logits, -1)
    assert ids.tolist() == [1] and torch.isclose(chosen[0], logp[0, 1])
    assert top_ids[0, :3].tolist() == [1, 0, 2] and torch.allclose(top_lp[0, :3], logp[0, [1, 0, 2]])
