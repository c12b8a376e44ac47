from lightning_pp.plan.app import main

main()
