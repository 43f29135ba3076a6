"""Model implementations (python code). hosted/models/demo/ holds the bundled demo checkpoint."""

# The bundled demo checkpoint, relative to the repository root (where `switchyard` commands run): the default
# output of `switchyard engine train-demo`. The gateway's policy default names the same directory.
DEMO_MODEL_DIR = "hosted/models/demo"
