"""The adversarial corpus (issues 16 and 30): every bad input, hostile store file and lossy round trip found so
far, kept as data so it stays fixed.

- ``framework``: :class:`~adversarial.framework.Case` (a command line or an API call, its input, its expected
  outcome), the context every case builds in, the runner and the checks;
- ``cases_bad_input``: issue 16's bad inputs (foreign files, names, shapes, references, catalogs, peers);
- ``cases_issue30``: issue 30's adversarial pass, one case per reproduction, and their neighbours;
- ``cases_issue40a``: issue 40's first part (ownership, read-only queries, secrets, references), one case per
  reproduction and variants;
- ``cases_issue40b``: issue 40's second part (object types, safetensors tiling, FIFOs, full disks, read-only
  stores, look-alike names, the universal export's path clash);
- ``test_corpus``: runs every case in CI; ``tools/fault_table.py --corpus`` prints the counts.
"""

from . import cases_bad_input, cases_issue30, cases_issue40a, cases_issue40b

CASES = cases_bad_input.CASES + cases_issue30.CASES + cases_issue40a.CASES + cases_issue40b.CASES
