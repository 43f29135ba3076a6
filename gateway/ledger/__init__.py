"""The cost ledger: schema (models.py), one request's row (record.py), the batch writer (writer.py)."""
