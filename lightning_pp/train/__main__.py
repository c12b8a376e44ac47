from lightning_pp.train.app import main

main()
