"""Building blocks of the engine's models, one concern per file."""
