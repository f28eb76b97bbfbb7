"""The fake's platform: sleep mode is available (the fake sleeps on CPU; real vLLM refuses it there)."""


class _CpuFake:
    device_type = "cpu"

    @staticmethod
    def is_sleep_mode_available() -> bool:
        return True


current_platform = _CpuFake()
