"""The pytest plugin's fixture in a test of your own: `pytest examples/test_my_attention.py`."""

from my_attention import MyAttention


def test_my_attention_is_causal(attention_audit):
    report = attention_audit(MyAttention(), causal=True)  # fails the test, showing the report, on a finding
    assert report.result("future_leakage").verdict == "pass"
