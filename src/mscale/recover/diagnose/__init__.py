"""``diagnose(run_dir) -> Diagnosis``: what went wrong in a run's last attempt, and who is suspect.

Three steps, each its own module, so that the reading, the rules and the judgement are tested
apart: `evidence` reads what the run left, boundedly (`read`) and scoped to the last attempt;
`facts` turns it into findings with the rule tables of `rules`; `classify` lets the finding of
highest weight decide class, symptom and transience, names the suspects (the hung rank for a hang,
`hang`; the first failed rank for a crash; nobody for a preemption, a NaN or a stop on request)
and keeps the evidence lines, most telling first, one line for what many ranks said alike.
Nothing here raises on a damaged run directory: what could not be read is listed as evidence.
"""

from mscale.recover.diagnose.classify import decide, diagnose

__all__ = ["decide", "diagnose"]
