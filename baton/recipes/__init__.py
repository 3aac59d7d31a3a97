"""Recipes: the shipped demos' presets (SFT, then a second stage from its checkpoint), which `examples/*.yaml` name
by `pipeline_cls`. Nothing in the library imports them; a recipe is a starting point to copy."""
