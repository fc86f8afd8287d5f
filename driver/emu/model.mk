# driver/emu/model.mk: the emulated NIC's model in two translation units (driver/emu/Makefile, PARALLEL=0).
# HF_STEP=split (alone, after Verilator wrote its makefiles): writes Vhypafilter_core__hf_fast.cpp, which includes
# every per-cycle file Verilator wrote, and Vhypafilter_core__hf_slow.cpp, every file that runs once (construction,
# initial settle, the symbol table). Otherwise (read after Vhypafilter_core.mk, whose class lists the Makefile
# replaces by these two units): HF_PCH=1 (clang++ with ccache) compiles each unit after a precompiled verilated.h
# built with the unit's own flags (clang refuses a header precompiled with other defines or another -O); ccache
# (sloppiness pch_defines and time_macros, these targets only) keeps the precompiled header, so a clone builds it
# once.
PREFIX := Vhypafilter_core

ifeq ($(HF_STEP),split)
include $(PREFIX)_classes.mk
.PHONY: split
split:
	printf '#include "%s.cpp"\n' $(VM_CLASSES_FAST) $(VM_SUPPORT_FAST) > $(PREFIX)__hf_fast.cpp
	printf '#include "%s.cpp"\n' $(VM_CLASSES_SLOW) $(VM_SUPPORT_SLOW) > $(PREFIX)__hf_slow.cpp
else ifeq ($(HF_PCH),1)
# the flags of the units as verilated.mk compiles them, taken before the per-target additions below
HF_PCH_FLAGS := $(CXXFLAGS) $(CPPFLAGS) -Xclang -fno-pch-timestamp -x c++-header $(VERILATOR_ROOT)/include/verilated.h
hf_fast.pch: export CCACHE_SLOPPINESS = pch_defines,time_macros
hf_fast.pch:
	$(OBJCACHE) $(CXX) $(HF_PCH_FLAGS) $(OPT_FAST) -o $@
hf_slow.pch: export CCACHE_SLOPPINESS = pch_defines,time_macros
hf_slow.pch:
	$(OBJCACHE) $(CXX) $(HF_PCH_FLAGS) $(OPT_SLOW) -o $@
$(PREFIX)__hf_fast.o: hf_fast.pch
$(PREFIX)__hf_fast.o: private CXXFLAGS += -include-pch hf_fast.pch
$(PREFIX)__hf_slow.o: hf_slow.pch
$(PREFIX)__hf_slow.o: private CXXFLAGS += -include-pch hf_slow.pch
endif
