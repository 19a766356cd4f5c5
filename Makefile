# idempotency: PGXS build of the PostgreSQL extension
EXTENSION   = idempotency
MODULE_big  = idempotency
OBJS        = src/module.o src/guc.o src/fingerprint.o src/catalog.o \
              src/row.o src/write.o src/token.o src/direct.o src/keylock.o src/wait.o \
              src/stats.o src/sweep.o src/worker.o src/tenant.o src/session.o \
              src/citus.o src/args.o src/claim.o src/holder.o src/lookup.o \
              src/forget.o
DATA        = $(wildcard idempotency--*.sql)
PGFILEDESC  = "idempotency - idempotency keys for PostgreSQL"

# Every file in sql/ is a pg_regress test, every file in specs/ an
# isolation test, every t/*.pl a TAP test: adding a test is adding a file.
# The suites need the server settings in test/test.conf (the library
# preloaded, the background sweeper off: the tests decide who sweeps and
# when).  ./run test starts its servers with them; with
# EXTRA_REGRESS_OPTS=--temp-instance=tmp_check, pg_regress starts one itself.
REGRESS      = $(patsubst sql/%.sql,%,$(sort $(wildcard sql/*.sql)))
REGRESS_OPTS = --inputdir=. --load-extension=idempotency \
               --temp-config=$(srcdir)/test/test.conf
ISOLATION    = $(patsubst specs/%.spec,%,$(sort $(wildcard specs/*.spec)))
ISOLATION_OPTS = --load-extension=idempotency \
                 --temp-config=$(srcdir)/test/test.conf
TAP_TESTS    = 1

PG_CPPFLAGS = -I$(srcdir)/src

# A test build (make IDEM_TEST_PAUSES=1, as ./run test builds) adds the
# pause points that the isolation specs named pause_* need to force one
# exact interleaving; any other build leaves those specs out.
ifdef IDEM_TEST_PAUSES
OBJS        += src/pause.o
PG_CPPFLAGS += -DIDEM_TEST_PAUSES
else
ISOLATION   := $(filter-out pause_%,$(ISOLATION))
endif

# fingerprint.c calls OpenSSL's SHA-256 directly when PostgreSQL uses OpenSSL
SHLIB_LINK  = $(filter -lcrypto, $(LIBS))
# ./run test adds -Werror (COPT); a packager's build must not fail on a
# warning that a newer compiler invents.
PG_CFLAGS   = -Wall -Wextra -Wno-unused-parameter \
              -Wno-missing-field-initializers -Wno-sign-compare

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# PGXS tracks header dependencies only on a server configured with
# --enable-depend: elsewhere a struct changed in a header would leave the
# objects (and JIT bitcode) built against its old layout.  Each is rebuilt
# when any of the project's headers changes.
$(OBJS) $(OBJS:.o=.bc): $(wildcard $(srcdir)/src/*.h)

# make dist: the PGXN release zip, idempotency-<version>.zip, in this directory
.PHONY: dist
dist:
	$(srcdir)/scripts/dist.sh $(CURDIR)

# make sql-edition: the SQL edition's installers (pg_tle and plain), built
# from sql-edition/ into dist/sql-edition/
.PHONY: sql-edition
sql-edition:
	$(srcdir)/scripts/sql-edition.sh $(CURDIR)/dist/sql-edition
