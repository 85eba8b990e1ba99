"""The data plane. Kept free of torch imports: loader processes import this package."""
