from tests.integrations.transformers_gate import skip_unless_supported

skip_unless_supported()
