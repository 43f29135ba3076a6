"""Offline tools that build artefacts for the engine (the demo checkpoint and its corpus), not the serving
path: nothing in the engine or its server imports this package; `switchyard engine train-demo` runs it."""
