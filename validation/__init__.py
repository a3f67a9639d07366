"""Promotion gates: Great Expectations suites in code (data) and the served-quality gate; a failed gate raises.

Great Expectations takes seconds to import: it is imported inside the functions that validate.
"""
