
# Copyright: the idempotency extension authors.
#
# 205_tenant_fail_closed.pl: a tenant's scope binding holds even when the
# session's load of the bindings is interrupted.
#
# Each session reads idempotency.scope_bindings once into a cache, and again
# after a change to the table.  A load that fails half-way (its lock wait
# times out, it is cancelled, it runs out of memory) must leave the cache
# invalid: the call that failed is refused with the error, and the next call
# loads again.  A cache marked valid before it is filled would let the bound
# role use any scope until the next change of the bindings.
#
# What it proves, with a tenant bound to 'a:' that logs in as itself, in a
# fresh session (nothing cached yet), while a superuser holds
# scope_bindings locked in an open transaction:
#   - lock_timeout: the claim fails with 55P03 (lock timeout); once the lock
#     is gone, the same session's claim outside 'a:' is refused (42501), no
#     row or token is written for it, and a claim inside 'a:' works;
#   - a cancel (pg_cancel_backend) while the load waits for the lock: the
#     claim fails with 57014; after the lock is gone the same session is
#     still refused outside 'a:', through idem_claim and idem_lookup.
# Every wait is for a condition the test controls: the lock is held until
# the test commits, and the cancel is sent once pg_locks shows the tenant's
# backend waiting for that lock.
#
# Run as described at the top of t/001_restart.pl.  Port 55451 only names
# the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = new_node('fail_closed', port => 55451,
	conf => ['idempotency.sweep_interval = 0']);
install_extension($node, 'postgres');
$node->safe_psql(
	'postgres', q{
CREATE ROLE tenant_a LOGIN;
GRANT USAGE ON SCHEMA idempotency TO tenant_a;
SELECT idempotency.bind_scope('tenant_a', 'a:');
});

sub sql { return $node->safe_psql('postgres', $_[0]); }

# How many keys are stored outside the tenant's prefix.
sub foreign_rows
{
	return sql("SELECT count(*) FROM idempotency.keys WHERE scope NOT LIKE 'a:%'");
}

# A superuser session holding scope_bindings in ACCESS EXCLUSIVE mode.
sub hold_bindings
{
	my $h = $node->background_psql('postgres');
	$h->query_safe(
		'BEGIN; LOCK idempotency.scope_bindings IN ACCESS EXCLUSIVE MODE');
	return $h;
}

# A fresh session logged in as tenant_a; its backend pid.
sub tenant_session
{
	my $s = $node->background_psql('postgres', on_error_stop => 0,
		extra_params => [ '-U', 'tenant_a' ]);
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	return ($s, $pid);
}

# Run $sql in background session $s; (stdout, SQLSTATE of its error or '00000').
sub run_in
{
	my ($s, $sql) = @_;
	$s->{stderr} = '';
	my $out = $s->query("\\set VERBOSITY verbose\n$sql");
	my $state = $s->{stderr} =~ /ERROR:\s+([0-9A-Z]{5}):/ ? $1 : '00000';
	return ($out, $state, $s->{stderr});
}

# A token drawn now, by a claim the key of which is released at once.  One
# session draws tokens at a time here, and they come one after the other
# (from the sequence, or from the block it reserves ahead when the library
# is preloaded), so two probes tell how many were drawn in between.
my $probes = 0;

sub probe_token
{
	my $key = 'probe-' . ++$probes;
	my $token = sql("SELECT token FROM idempotency.idem_claim('$key', scope => 'a:probe')");
	sql("SELECT idempotency.idem_release('$key', $token, 'a:probe')");
	return $token;
}

my $tokens_before = probe_token();

# --- the load's lock wait times out -------------------------------------------

my $holder = hold_bindings();
my ($tenant, $pid) = tenant_session();
my ($out, $state, $err) = run_in($tenant,
	"SET lock_timeout = '100ms';\n"
	  . "SELECT outcome FROM idempotency.idem_claim('k1', scope => 'b:orders')");
is($state, '55P03', 'lock timeout: the claim that loads the bindings fails (55P03)');
like($err, qr/lock timeout/, '... with the lock timeout as its error');
$holder->query_safe('COMMIT');
$holder->quit;

($out, $state, $err) = run_in($tenant,
	"RESET lock_timeout;\n"
	  . "SELECT outcome FROM idempotency.idem_claim('k2', scope => 'b:stolen')");
is($state, '42501',
	'after the timed-out load, a claim outside the prefix is refused (42501)');
($out, $state) = run_in($tenant,
	"SELECT outcome FROM idempotency.idem_claim('k2', scope => 'a:mine')");
is($state, '00000', 'a claim inside the prefix works');
is($out, 'claimed', '... and is claimed');
is(foreign_rows(), '0', 'no key was stored outside the prefix');
$tenant->quit;

# --- the load is cancelled while it waits for its lock ------------------------

$holder = hold_bindings();
($tenant, $pid) = tenant_session();
$tenant->{stderr} = '';
$tenant->query_until(qr/started\n/,
	    "\\set VERBOSITY verbose\n\\echo started\n"
	  . "SELECT outcome FROM idempotency.idem_claim('k3', scope => 'b:orders');\n"
	  . "\\echo done\n");
ok( $node->poll_query_until(
		'postgres',
		"SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $pid AND NOT granted "
		  . "AND relation = 'idempotency.scope_bindings'::regclass)"),
	'cancel: the tenant waits for its lock on scope_bindings');
is(sql("SELECT pg_cancel_backend($pid)"), 't', 'the waiting claim is cancelled');
$tenant->query_until(qr/done\n/, '');
like($tenant->{stderr}, qr/ERROR:\s+57014:/, '... and fails with 57014');
$holder->query_safe('COMMIT');
$holder->quit;

($out, $state) = run_in($tenant,
	"SELECT outcome FROM idempotency.idem_claim('k4', scope => 'b:stolen')");
is($state, '42501',
	'after the cancelled load, a claim outside the prefix is refused (42501)');
($out, $state) = run_in($tenant,
	"SELECT status FROM idempotency.idem_lookup('k4', 'b:stolen')");
is($state, '42501', '... and so is a lookup');
($out, $state) = run_in($tenant,
	"SELECT outcome FROM idempotency.idem_claim('k4', scope => 'a:mine')");
is($out, 'claimed', 'a claim inside the prefix works');
$tenant->quit;

is(foreign_rows(), '0', 'no key was ever stored outside the prefix');
is(probe_token(), $tokens_before + 3,
	'exactly two tokens were drawn between the probes: the two claims inside the prefix');

$node->stop;
done_testing();
