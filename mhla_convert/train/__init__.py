"""Fine-tuning converted models: recipes (YAML), attention transfer and fine-tune stages under
Accelerate, checkpoints and resume, sampling. Entry points: `mhla-convert finetune` / `sample`,
`accelerate launch -m mhla_convert.train RECIPE.yaml --out DIR`."""

from .errors import RecipeError, TrainError
from .recipe import Recipe, load_recipe, parse_recipe

__all__ = ["Recipe", "RecipeError", "TrainError", "load_recipe", "parse_recipe", "train"]


def train(*args, **kwargs):
    from .trainer import train as _train

    return _train(*args, **kwargs)
