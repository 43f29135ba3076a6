"""Buy-versus-host reports over the ledger."""
