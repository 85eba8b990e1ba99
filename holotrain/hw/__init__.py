from holotrain.hw.peak import peak_bf16_flops

__all__ = ["peak_bf16_flops"]
