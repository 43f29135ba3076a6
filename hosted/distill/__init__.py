"""`switchyard engine distill`: train a small draft model to imitate a target, for speculative decoding
(DistillSpec: on-policy data from the teacher, a divergence over the teacher's token distributions).

prompts.py   the prompts: a --prompts file, or a default set built from the standard library
teacher.py   the teacher's on-policy continuations and top-k distributions, through our batched engine
student.py   the trainable draft (narrow head, layers from the teacher) and its export as an engine checkpoint
losses.py    forward KL, reverse KL and Jensen-Shannon over the head's tokens
trainer.py   the training loop: deterministic batches, resumable checkpoints, clean stop on Ctrl-C
acceptance.py  the draft's acceptance rate, measured by the engine's own speculative decoding
run.py       the phases in order, each resumable from the work directory
"""
