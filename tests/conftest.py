def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end test that trains tiny models (deselect with -m 'not slow')")
