"""`python -m mhla_convert.train RECIPE.yaml --out DIR` (and under `accelerate launch -m`)."""

from .commands import main

main()
