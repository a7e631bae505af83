"""Checkpoints the speculative-decoding tests share."""

from __future__ import annotations

import pytest

from hybridserve.model.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def spec_tiny(tmp_path_factory):
    """A random-weight tiny checkpoint with a random MTP layer: drafts almost always
    rejected."""
    root = tmp_path_factory.mktemp("spec-tiny")
    return str(write_tiny_checkpoint(root / "a", preset="test-a", seed=5))


@pytest.fixture(scope="module", params=["random", "trained"])
def any_spec_ckpt(request, spec_tiny):
    """The random-weight checkpoint (every rejection path) and the trained default
    model, whose MTP layer was trained with it (most drafts accepted: commits of
    several rows)."""
    if request.param == "random":
        return spec_tiny
    from hybridserve import default_model

    return str(default_model.path())
