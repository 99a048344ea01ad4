"""The fault campaign: many seeded runs of real engines under faults, every KV byte checked.

`python -m harness.campaign` (make chaos) and tests/test_campaign.py (CI's short one).
A seed draws its plan (harness.campaign.plan); harness.campaign.run runs and judges it.
"""
