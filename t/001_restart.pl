
# Copyright: the idempotency extension authors.
#
# 001_restart.pl: finished and pending keys survive a clean restart and a
# crash (immediate shutdown, then crash recovery).
#
# How to run the TAP tests (t/*.pl)
# ---------------------------------
# PostgreSQL refuses to run as root, so the tests run as the postgres OS user,
# from a copy of the repository that user can write (tmp_check/ is created in
# $TESTDIR), with the extension installed (make install):
#
#   cp -a /work/main /tmp/idem-tap && chown -R postgres: /tmp/idem-tap
#   cd /tmp/idem-tap && runuser -u postgres -- env \
#     PATH=/usr/lib/postgresql/15/bin:$PATH \
#     PERL5LIB=/usr/lib/postgresql/15/lib/pgxs/src/test/perl \
#     TESTDIR=/tmp/idem-tap \
#     PG_REGRESS=/usr/lib/postgresql/15/lib/pgxs/src/test/regress/pg_regress \
#     prove -v t/*.pl
#
# (`make installcheck` run as postgres in such a copy does the same: the
# Makefile sets TAP_TESTS = 1, and PGXS runs prove with these variables.)
# Do not set top_builddir: the port lock directory would then go below
# /usr/lib/postgresql.  Logs: $TESTDIR/tmp_check/log/regress_log_<test> (the
# test's own log) and $TESTDIR/tmp_check/log/<test>_<node>.log (the server's).
# Set PG_TEST_NOCLEAN=1 to keep the data directories.  Each test starts its own
# server on a private Unix socket directory; the ports are fixed in the range
# given to the TAP tests (55441 for 001, 55442 for 002, 55443 for 003) and
# only name the socket file, so concurrent runs do not collide.  No test
# asserts anything about timing: leases are waited out by polling the table.
# What the tests share (node set-up, SQL and its SQLSTATE, claims, waiting
# for the worker) is in t/lib/IdemTest.pm; prove runs t/*.pl only.  The same
# files test the SQL edition with IDEM_EDITION=plain or pgtle (see
# IdemTest.pm), as `SUITE=tap scripts/sql-edition-test.sh MODE PG_CONFIG`
# runs them.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = new_node('restart', port => 55441, extension => 1);

# Every token the server has handed out so far, committed or not.
my @tokens;
sub max_token { return max(0, @tokens); }

sub sql { return $node->safe_psql('postgres', $_[0]); }

# The stable part of a pending key whose lease may end while we look: the
# sweeper may reset it (token, sweep_at) but must not change the rest.
sub stored_pending_core
{
	my ($scope, $key) = @_;
	return sql(
		"SELECT status, attempt, encode(fingerprint, 'hex'), response_code, "
		  . "response_body IS NULL, created_at, finished_at, retention "
		  . "FROM idempotency.keys WHERE scope = '$scope' AND key = '$key'");
}

sub lookup
{
	my ($scope, $key) = @_;
	return sql(
		"SELECT status, attempt, response_code, md5(response_body::text), "
		  . "created_at, finished_at, expires_at "
		  . "FROM idempotency.idem_lookup('$key', scope => '$scope')");
}

# The responses stored by populate(), and their md5 as PostgreSQL prints them.
my $ok_body     = q{'{"order": 1, "total": 100.0, "items": [1, 2, 3]}'};
my $failed_body = q{'{"error": "upstream timeout", "retry": false}'};
my $scope_body  = q{'{"tenant": 2}'};
my $pend_body   = q{'{"late": "but alive"}'};
my $big_body =
  q{(SELECT jsonb_build_object('n', 6000, 'blob', }
  . q{string_agg(md5(i::text), '' ORDER BY i)) }
  . q{FROM generate_series(1, 6000) AS i)};

my %md5;
$md5{ok}     = body_md5($node, 'postgres', $ok_body);
$md5{failed} = body_md5($node, 'postgres', $failed_body);
$md5{scope}  = body_md5($node, 'postgres', $scope_body);
$md5{pend}   = body_md5($node, 'postgres', $pend_body);
$md5{big}    = body_md5($node, 'postgres', $big_body);

my %pending_token;    # "scope/key" => token of the committed pending claim

# Claim and finish a set of keys named "$p-...", leave two pending.
sub populate
{
	my ($p) = @_;
	my $c;

	$c = claim($node, 'postgres', "'$p-ok', request => '{\"order\": 1}', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$p-ok: claimed");
	is($c->{attempt}, 1,         "$p-ok: attempt 1");
	cmp_ok($c->{token}, '>', max_token(), "$p-ok: token above every earlier token");
	push @tokens, $c->{token};
	sql("SELECT idempotency.idem_finish('$p-ok', $c->{token}, 201, $ok_body)");

	# Finished keys compared whole (sweep_at too) across restarts are claimed
	# with a lease of an hour: the worker meets a finished key first when
	# its claim's lease ends, and then moves its sweep_at.
	$c = claim($node, 'postgres', "'$p-failed', request => '{\"order\": 2}', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$p-failed: claimed");
	cmp_ok($c->{token}, '>', max_token(), "$p-failed: token above every earlier token");
	push @tokens, $c->{token};
	sql("SELECT idempotency.idem_finish('$p-failed', $c->{token}, 502, "
		  . "$failed_body, status => 'failed')");

	$c = claim($node, 'postgres', "'$p-big', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$p-big: claimed");
	push @tokens, $c->{token};
	sql("SELECT idempotency.idem_finish('$p-big', $c->{token}, 200, $big_body)");

	# Same key in another scope, with another request and response.
	$c = claim($node, 'postgres',
		"'$p-ok', request => '{\"order\": 99}', scope => 'tenant-2', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "tenant-2/$p-ok: claimed (scopes are apart)");
	push @tokens, $c->{token};
	sql("SELECT idempotency.idem_finish('$p-ok', $c->{token}, 200, "
		  . "$scope_body, scope => 'tenant-2')");

	# Pending, committed claims: one with a long lease, one that runs out.
	$c = claim($node, 'postgres',
		"'$p-pend-long', request => '{\"job\": 1}', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$p-pend-long: claimed");
	push @tokens, $c->{token};
	$pending_token{"/$p-pend-long"} = $c->{token};

	$c = claim($node, 'postgres',
		"'$p-pend-short', request => '{\"job\": 2}', lease => '1 second'");
	is($c->{outcome}, 'claimed', "$p-pend-short: claimed");
	push @tokens, $c->{token};
	$pending_token{"/$p-pend-short"} = $c->{token};
}

my @stable_keys = (
	[ '', 'ok' ], [ '', 'failed' ], [ '', 'big' ], [ 'tenant-2', 'ok' ],
	[ '', 'pend-long' ]);

# What the table and idem_lookup say about the keys of set $p.
sub snapshot
{
	my ($p) = @_;
	my %s;
	foreach my $k (@stable_keys)
	{
		my ($scope, $key) = ($k->[0], "$p-$k->[1]");
		$s{"row $scope/$key"}    = stored_row($node, 'postgres', $scope, $key);
		$s{"lookup $scope/$key"} = lookup($scope, $key);
	}
	$s{"core /$p-pend-short"} = stored_pending_core('', "$p-pend-short");
	return \%s;
}

# After a restart: the keys of set $p are exactly as they were, and replay.
sub verify
{
	my ($p, $before, $how) = @_;
	my $now = snapshot($p);
	foreach my $what (sort keys %$before)
	{
		is($now->{$what}, $before->{$what}, "$how: $what unchanged");
	}

	my $c = claim($node, 'postgres', "'$p-ok', request => '{\"order\": 1}'");
	is_deeply($c, replay_row('succeeded', 201, $md5{ok}),
		"$how: $p-ok replays the stored success");

	# Finished keys compared whole (sweep_at too) across restarts are claimed
	# with a lease of an hour: the worker meets a finished key first when
	# its claim's lease ends, and then moves its sweep_at.
	$c = claim($node, 'postgres', "'$p-failed', request => '{\"order\": 2}', lease => '1 hour'");
	is_deeply($c, replay_row('failed', 502, $md5{failed}),
		"$how: $p-failed replays the stored failure");

	$c = claim($node, 'postgres', "'$p-big'");
	is($c->{outcome},       'replay',  "$how: $p-big replays");
	is($c->{response_code}, 200,       "$how: $p-big response code");
	is($c->{body_md5},      $md5{big}, "$how: $p-big returns the identical large body");
	is( sql("SELECT response_body->>'n' FROM idempotency.idem_claim('$p-big')"),
		'6000', "$how: $p-big body is readable jsonb");

	$c = claim($node, 'postgres',
		"'$p-ok', request => '{\"order\": 99}', scope => 'tenant-2'");
	is($c->{outcome},  'replay',    "$how: tenant-2/$p-ok replays");
	is($c->{body_md5}, $md5{scope}, "$how: tenant-2/$p-ok has its own body");

	$c = claim($node, 'postgres', "'$p-ok', request => '{\"order\": 2}'");
	is_deeply($c, mismatch_row(),
		"$how: $p-ok with another request is a mismatch (fingerprint kept)");

	$c = claim($node, 'postgres', "'$p-pend-long', request => '{\"job\": 1}'");
	is($c->{outcome}, 'in_progress', "$how: $p-pend-long is still in progress");
	is($c->{token},   undef,         "$how: in_progress carries no token");
	cmp_ok($c->{retry_after}, '>', 1, "$how: $p-pend-long retry_after counts its long lease");
	cmp_ok($c->{retry_after}, '<=', 3600, "$how: $p-pend-long retry_after within its lease");

	is( sql("SELECT status || ',' || attempt || ',' || (response_code IS NULL) "
			  . "FROM idempotency.idem_lookup('$p-pend-short')"),
		'pending,1,true', "$how: $p-pend-short is still pending, attempt 1");

	$c = claim($node, 'postgres', "'$p-new-after-$how', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$how: a new key can be claimed");
	is($c->{attempt}, 1,         "$how: new key attempt 1");
	cmp_ok($c->{token}, '>', max_token(),
		"$how: new token is above every token issued before");
	push @tokens, $c->{token};
}

# The large body is really stored out of line (TOAST).
populate('a');
my $toast = sql(
	"SELECT reltoastrelid::regclass FROM pg_class "
	  . "WHERE oid = 'idempotency.keys'::regclass");
cmp_ok(sql("SELECT count(*) FROM $toast"), '>', 0,
	'the large response body is stored in the TOAST table');

# --- clean restart ---------------------------------------------------------
my $before_a = snapshot('a');
$node->restart;
verify('a', $before_a, 'clean restart');

# --- crash: immediate shutdown, with transactions in flight -----------------
populate('b');
my $before_b = snapshot('b');
$before_a = snapshot('a');

# A committed pending claim that an open transaction is finishing at the crash.
my $c = claim($node, 'postgres', "'b-pend-fin', request => '{\"job\": 3}', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'b-pend-fin: claimed');
push @tokens, $c->{token};
my $pend_fin_token = $c->{token};

# The open transaction first finishes b-pend-fin, then claims b-uncommitted
# as the first token after a checkpoint: that token's sequence WAL record is
# the one that must not be lost in the crash, or the token is issued again.
my $open = $node->background_psql('postgres');
$open->query_safe('BEGIN');
$open->query_safe(
	"SELECT idempotency.idem_finish('b-pend-fin', $pend_fin_token, 200, $pend_body)");
is(sql("SELECT status FROM idempotency.idem_lookup('b-pend-fin')"),
	'pending', 'the uncommitted finish is invisible to others');
sql('CHECKPOINT');
my $open_claim = parse_claim(
	$open->query_safe(
		"SELECT $CLAIM_COLS FROM idempotency.idem_claim('b-uncommitted', lease => '1 hour')"));
is($open_claim->{outcome}, 'claimed', 'open transaction: b-uncommitted claimed');
cmp_ok($open_claim->{token}, '>', max_token(), 'open transaction: token above every earlier token');
my $lost_token = $open_claim->{token};

my $log_offset = -s $node->logfile;
$node->stop('immediate');
eval { $open->quit; };
$node->start;
ok($node->log_contains(qr/automatic recovery in progress/, $log_offset),
	'the server went through crash recovery');

verify('a', $before_a, 'crash after restart');
verify('b', $before_b, 'crash');

# The transaction open at the crash left no trace.
is(lookup('', 'b-uncommitted'), '', 'b-uncommitted: absent after the crash');
is(sql("SELECT count(*) FROM idempotency.keys WHERE key = 'b-uncommitted'"),
	'0', 'b-uncommitted: no stored row');
$c = claim($node, 'postgres', "'b-uncommitted', lease => '1 hour'");
is($c->{outcome}, 'claimed', 'b-uncommitted: claimed again');
is($c->{attempt}, 1,         'b-uncommitted: as a first attempt');
cmp_ok($c->{token}, '>', max_token(),
	'b-uncommitted: new token above every committed token');
cmp_ok($c->{token}, '>', $lost_token,
	'b-uncommitted: new token above the token issued to the transaction lost in the crash');
push @tokens, $c->{token};

# The finish in flight at the crash is undone: the key is pending, and the
# claim's token is still current, so its owner can finish it now.
is( sql("SELECT status || ',' || attempt || ',' || (response_code IS NULL) "
		  . "FROM idempotency.idem_lookup('b-pend-fin')"),
	'pending,1,true', 'b-pend-fin: the finish lost in the crash left it pending');
is(sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('b-pend-fin', $pend_fin_token, 200, $pend_body)"),
	'00000', 'b-pend-fin: its token survived the crash and finishes it');
$c = claim($node, 'postgres', "'b-pend-fin', request => '{\"job\": 3}'");
is($c->{outcome},  'replay',   'b-pend-fin: replays after the finish');
is($c->{body_md5}, $md5{pend}, 'b-pend-fin: with the finished body');

# A pending key's owner survives two restarts and can still finish.
is(sqlstate_of($node, 'postgres',
		"SELECT idempotency.idem_finish('a-pend-long', $pending_token{'/a-pend-long'}, "
		  . "200, $pend_body)"),
	'00000', 'a-pend-long: the pre-restart token still finishes the key');
$c = claim($node, 'postgres', "'a-pend-long', request => '{\"job\": 1}'");
is($c->{outcome},       'replay',   'a-pend-long: replays');
is($c->{response_code}, 200,        'a-pend-long: response code');
is($c->{body_md5},      $md5{pend}, 'a-pend-long: body');

# Pending keys whose lease ran out are taken over: attempt 2, new token, and
# the pre-crash token is dead.
foreach my $p ('a', 'b')
{
	my $key = "$p-pend-short";
	my $old = $pending_token{"/$key"};
	ok(wait_lease_over($node, 'postgres', '', $key), "lease of /$key has ended");

	$c = claim($node, 'postgres', "'$key', request => '{\"job\": 2}', lease => '1 hour'");
	is($c->{outcome}, 'claimed', "$key: taken over after its lease");
	is($c->{attempt}, 2,         "$key: attempt 2");
	cmp_ok($c->{token}, '>', max_token(), "$key: takeover token above every earlier token");
	cmp_ok($c->{token}, '>', $lost_token, "$key: takeover token above the lost token");
	push @tokens, $c->{token};
	my $new = $c->{token};

	my $row = stored_row($node, 'postgres', '', $key);
	is( sqlstate_of($node, 'postgres',
			"SELECT idempotency.idem_finish('$key', $old, 200, $pend_body)"),
		'55006', "$key: the pre-crash token is dead (55006)");
	is(stored_row($node, 'postgres', '', $key), $row,
		"$key: the dead token's finish changed nothing");
	is( sql("SELECT status || ',' || token || ',' || attempt FROM idempotency.keys "
			  . "WHERE scope = '' AND key = '$key'"),
		"pending,$new,2", "$key: stored row is pending with the new token, attempt 2");

	is(sqlstate_of($node, 'postgres',
			"SELECT idempotency.idem_finish('$key', $new, 200, $pend_body, status => 'succeeded')"),
		'00000', "$key: the new owner finishes it");
	$c = claim($node, 'postgres', "'$key', request => '{\"job\": 2}'");
	is($c->{outcome},  'replay',   "$key: replays the new owner's result");
	is($c->{body_md5}, $md5{pend}, "$key: with its body");
	is(sql("SELECT attempt FROM idempotency.idem_lookup('$key')"),
		'2', "$key: lookup reports attempt 2");
}

# One more crash after all that: the finished takeovers are durable too.
my $before_final = sql(
	"SELECT string_agg(concat_ws(',', scope, key, status, token, attempt, "
	  . "response_code, md5(response_body::text), expires_at), E'\\n' "
	  . "ORDER BY scope, key) FROM idempotency.keys");
$node->stop('immediate');
$node->start;
is( sql("SELECT string_agg(concat_ws(',', scope, key, status, token, attempt, "
		  . "response_code, md5(response_body::text), expires_at), E'\\n' "
		  . "ORDER BY scope, key) FROM idempotency.keys"),
	$before_final, 'second crash: every stored key is unchanged');
$c = claim($node, 'postgres', "'final', lease => '1 hour'");
cmp_ok($c->{token}, '>', max_token(), 'second crash: token sequence continues upwards');

$node->stop;
done_testing();
