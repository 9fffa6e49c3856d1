"""The library's import surface: the engine, Egeria's method and the integrations import
without the ``bench`` extra (tqdm, matplotlib), and the public names stay where users
import them from."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest


def test_the_library_works_without_tqdm_and_matplotlib() -> None:
    # a fresh interpreter in which both are missing: the engine, the method, the baselines
    # and the cache import and train a step (torch.hub, imported by torch, has its own
    # fallback when tqdm is missing)
    code = """
import sys
sys.modules["tqdm"] = sys.modules["matplotlib"] = None  # an import of either raises ImportError
import torch, egeria, egeria.knowledge, egeria.policies, egeria.cache, egeria.checkpoint, egeria.cli
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="none"))
loss = model(torch.randn(8, 4)).square().mean()
loss.backward()
opt.step()
eg.step(loss)
eg.close()
print(egeria.cli.main(["demo", "--quick"]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "2"
    assert "egeria demo needs tqdm and matplotlib (the bench extra)" in done.stderr


def test_public_names() -> None:
    import egeria
    import egeria.knowledge
    from egeria.integrations import hf, lightning

    assert egeria.KnowledgeGuided is egeria.knowledge.KnowledgeGuided
    assert egeria.LRDropRule is egeria.knowledge.LRDropRule
    for name in ("Egeria", "EgeriaConfig", "partition_model", "sp_loss", "derive_eval_interval"):
        assert name in egeria.__all__ and hasattr(egeria, name)
    assert hf.EgeriaCallback.__name__ == lightning.EgeriaCallback.__name__ == "EgeriaCallback"


def test_the_method_s_old_place_in_policies_still_answers_with_a_warning() -> None:
    import egeria
    import egeria.policies

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert egeria.policies.KnowledgeGuided is egeria.KnowledgeGuided
    assert any("moved to egeria.knowledge.KnowledgeGuided" in str(w.message) for w in caught)
    assert all(issubclass(w.category, DeprecationWarning) for w in caught)
    with pytest.raises(AttributeError):
        egeria.policies.NoSuchPolicy  # noqa: B018
