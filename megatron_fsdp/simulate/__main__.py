from megatron_fsdp.simulate.command import main

main()
