"""Learning from traffic: mirror a sampled share of served requests to the other backend and label the pair.

A route with `shadow: {sample_rate, judge}` draws each request at admission (`ShadowRunner.ticket`). After
a sampled request is served (plain or streamed, status ok) its answer and a ticket go into a bounded queue
(`submit`, never blocks: a full queue drops the job and counts it). Worker tasks then

1. send the same request (not streamed) to the other of easy/hard — served by easy → ask hard, and the
   reverse; a request served by a fallback is skipped;
2. judge both answers: `exact` compares each with the reference the client sent in `metadata.reference`
   (whitespace collapsed, case folded), only sampled when present; a backend name asks that backend the
   yes/no question in JUDGE_SYSTEM / `judge_messages` once per answer;
3. write a `shadow_evals` row (prompt included: a shadow setting is an opt-in to storing prompts) through
   `ShadowEvalWriter`, the ledger's batched writer with its spool, so a database outage loses nothing.

Every mirrored and judge call is a ledger row too (route_reason `shadow` / `shadow_judge`, no API key, so
no budget pays for it), so what learning costs is visible in the same reports as everything else.

The modules, one job each:
  reference.py  the client's reference answer (`metadata.reference`): read it, keep it from upstreams
  judge.py      deciding whether an answer is right (exact match or a judge backend's yes/no)
  runner.py     sampling, the queue and its workers, the mirrored and judge calls, the shadow_evals row
"""
