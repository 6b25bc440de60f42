"""TensorBoard tags of kerasdbg's records, built here (and parsed in `rules.rule`).

- `gradients/<variable path>/<stat>`: the gradient the model produced for a
  variable (before clipping; with gradient accumulation, each batch's);
- `gradients/global_norm`: the norm of all the gradients one optimizer step
  applies; with several optimizers, `gradients/<optimizer>/global_norm`;
- `applied_gradients/<variable path>/<stat>` and
  `applied_gradients/global_norm`: what the optimizer applied, recorded only
  when it differs from the model's gradient by construction (clipping,
  gradient accumulation);
- `gradients/clipped` (`gradients/<optimizer>/clipped`): 1 at the steps where
  clipping changed the gradient, else 0;
- `weights/<variable path>/<stat>`;
- `step/<name>`: one value per train step (`step/loss`, `step/frozen`, and
  every scalar the train step returns).

`<optimizer>` is where the model keeps the optimizer (`d_optimizer`,
`discriminator.optimizer`); a model trained by one optimizer keeps the
shorter tags.
"""

from __future__ import annotations

from typing import Optional

APPLIED_GRADIENTS = "applied_gradients"
STEP = "step"


def statistic(kind: str, path: str, stat: str) -> str:
    """`<kind>/<variable path>/<stat>`."""
    return f"{kind}/{path}/{stat}"


def per_optimizer(kind: str, name: str, optimizer: Optional[str]) -> str:
    """`<kind>/<name>`, or `<kind>/<optimizer>/<name>` when several
    optimizers train the model."""
    return f"{kind}/{name}" if optimizer is None else f"{kind}/{optimizer}/{name}"


def step_scalar(name: str) -> str:
    """`step/<name>`."""
    return f"{STEP}/{name}"


def column(tag: str, kind: str) -> str:
    """The `history` column of `tag` in a callback recording `kind`: the tag
    without its `<kind>/` prefix (other tags keep theirs)."""
    prefix = f"{kind}/"
    return tag[len(prefix):] if tag.startswith(prefix) else tag
