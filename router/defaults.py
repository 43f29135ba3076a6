"""Training defaults shared by router.train and the CLI (no imports: `switchyard --help` stays fast)."""

LABEL_RULES = ("gain", "strong_only", "weak_wrong", "skip_both_wrong")
DEFAULT_LABEL_RULE = "gain"
DEFAULT_C = 0.3  # 5-fold CV on MMLU and the seed set; see docs/router.md
