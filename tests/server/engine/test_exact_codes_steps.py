"""A float32 checkpoint whose layer weights are of Q4_1 form and whose head is of Q8_0 form (as the default model's
are) is served from their exact copies (models/exact_codes.py): every layer linear reads its 4-bit copy, the head
its 8-bit one, and greedy requests served together still match transformers' generate token for token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from models import exact_codes, native_matmul
from models.prepack import _PACKED
from models.sampling import SamplingParams
from server.compose import build_model, engine_for
from tests.server.engine.test_engine import solo, started
from tests.support.exact_forms import q4_form, q8_form
from tests.support.tiny import build_tiny_checkpoint, tiny_settings

pytestmark = pytest.mark.skipif(not exact_codes.available(), reason="needs the native kernels with AVX2 and FMA")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama (a vocabulary of 416, a multiple of 32) whose decoder layers' linear weights are rewritten in
    Q4_1 form and its lm_head in Q8_0 form."""
    from transformers import AutoModelForCausalLM

    path = Path(build_tiny_checkpoint(tmp_path_factory.mktemp("q4") / "tiny", vocab_words=396))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.copy_(q4_form(module.weight))
        head = model.get_output_embeddings()
        head.weight.copy_(q8_form(head.weight))
    model.save_pretrained(path)
    return str(path)


def test_layers_read_the_exact_copy_and_greedy_matches_generate(checkpoint: str) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    work = [([7, 8, 9, 10], 12), ([100, 200, 300], 9), (list(range(20, 45)), 7), ([5] * 30, 10)]

    async def main() -> list[list[int]]:
        s = tiny_settings()
        engine = await started(engine_for(s, build_model(s, checkpoint), None))
        try:
            layers = [m for name, m in engine.model.runner.model.named_modules()
                      if isinstance(m, torch.nn.Linear) and ".layers." in name]
            assert len(layers) == 14
            for module in layers:
                entry = _PACKED[module.weight.data_ptr()]
                assert entry.exact is not None and entry.few is not None
                assert entry.few[0] == native_matmul.EXACT4_F32
            head = _PACKED[engine.model.runner.model.get_output_embeddings().weight.data_ptr()]
            assert head.exact is not None and head.screen is not None and head.exact[0].dtype == torch.int8
            handles = [engine.submit(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                       for ids, n in work]
            out = []
            for h in handles:
                out.append([e.token_id async for e in h if e.token_id is not None])
            return out
        finally:
            engine.stop()

    for (ids, n), got in zip(work, asyncio.run(main())):
        assert got == solo(reference, ids, n)
