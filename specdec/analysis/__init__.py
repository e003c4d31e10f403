"""Explaining speculative decoding runs: speedup estimates (speedup.py) and rejection causes.

Rejection analysis (`specdec analyze`): rejections.py records one DraftTokenRecord per verified draft
token through an engine observer and aggregates them into an `Analysis` (JSON schema documented in
`rejections.ANALYSIS_SCHEMA`); findings.py writes sentences from its numbers; rejection_report.py
renders analysis.json / analysis.md / plots; analyze.py runs a task set and holds the CLI hooks.
"""
