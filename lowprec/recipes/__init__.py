"""The recipe catalog: named starting points, each derived from a baseline by ``dataclasses.replace``."""

from lowprec.recipes.catalog import CATALOG, get_recipe, recipe_names

__all__ = ["CATALOG", "get_recipe", "recipe_names"]
