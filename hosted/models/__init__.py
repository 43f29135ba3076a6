"""Model implementations (python code). hosted/models/demo/ holds the bundled demo checkpoint."""
