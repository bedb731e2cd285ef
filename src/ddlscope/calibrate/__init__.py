"""`ddlscope calibrate`: measure this machine for the local predictor (predict/local.py).

- probes.py: what is measured, in this process and in launched gloo ranks (torch);
- fit.py: the alpha-beta and matmul fits (numpy);
- machine.py: `calibrate()`, the whole profile of this machine;
- profile.py: the profile's typed layout and its TOML file;
- facts.py: `workload_facts`, one rank's step as the local predictor reads it.

The profile is a TOML file, and `ddlscope calibrate` keeps it in the store too.
Everything that needs torch is here, not in ddlscope.predict, which stays
torch-free; importing this package imports no torch (the probes and the facts
import it when they run).
"""

from ddlscope.calibrate.facts import facts_key, workload_facts
from ddlscope.calibrate.fit import fit_alpha_beta, fit_matmul
from ddlscope.calibrate.machine import calibrate, message_sizes
from ddlscope.calibrate.probes import COLLECTIVES, PROBES, collective_worker, measure_collectives, measure_compute
from ddlscope.calibrate.profile import DEFAULT_PROFILE, CalibrationProfile, load_profile, to_toml, write_profile

__all__ = [
    "facts_key",
    "COLLECTIVES", "DEFAULT_PROFILE", "PROBES", "CalibrationProfile", "calibrate", "collective_worker",
    "fit_alpha_beta", "fit_matmul", "load_profile", "measure_collectives", "measure_compute", "message_sizes",
    "to_toml", "workload_facts", "write_profile",
]
