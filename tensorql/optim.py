"""``import tensorql.optim`` / ``from tensorql.optim import Adam``: the optimizers of
:mod:`tensorql.api.optim` (``tq.optim`` names the same classes).

>>> import tensorql.optim, tensorql.api.optim
>>> tensorql.optim.Adam is tensorql.api.optim.Adam
True
"""

from tensorql.api.optim import SGD, Adam, AdamW, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
