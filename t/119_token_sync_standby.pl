
# Copyright: the idempotency extension authors.
#
# 119_token_sync_standby.pl: with a synchronous standby, no fencing token
# leaves the primary before the standby has confirmed the sequence record
# that covers it, as a commit waits for it, so that a failover to that
# standby never hands the token out again.  The library is preloaded, so
# tokens come from a block that a refill reserves ahead of need; the blocks
# here hold a single token (idempotency.test_token_block = 1, a test
# build's setting), so every claim refills, and a refill moves the limit up
# only once the standby has confirmed its sequence record.
#
# What it proves, with the standby stopped (it confirms nothing):
#   - a claim inside an open transaction waits for the standby (wait event
#     SyncRep) in the refill after its draw; a cancel ends the wait with
#     query_canceled (57014) and no token;
#   - a claim that finds the block used up waits for the refill under way
#     in another session (wait event Extension); when that refill is
#     cancelled (57014, no token), the waiting claim refills itself and
#     waits for the standby in turn;
#   - a batch of 40 claims in an open transaction waits too, and it and the
#     waiting claim return their tokens only once the standby is started
#     again and has confirmed;
#   - after the primary crashes (an immediate stop) and the standby is
#     promoted, every token the new primary issues is above every token a
#     client saw, none is issued again, and nothing of the open
#     transactions is stored.
#
# The SQL edition cannot wait for a standby from SQL: the file is skipped
# there; a build without test settings skips it too.  Run as described at
# the top of t/001_restart.pl.  Ports 55461 and 55462 only name the socket
# files.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max min);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition('its token calls flush the WAL but cannot wait for a '
	  . 'synchronous standby (sql-edition/README.md)');

my $primary = new_node('primary', port => 55461,
	init => [ allows_streaming => 1 ],
	conf => ["idempotency.sweep_interval = 0", "idempotency.test_token_block = 1"],
	extension => 1);
if ($primary->safe_psql('postgres',
		"SELECT current_setting('idempotency.test_token_block', true) IS NULL") eq 't')
{
	$primary->stop;
	plan(skip_all => 'needs a test build (make IDEM_TEST_PAUSES=1)');
}
# The base backup is taken before the standby is named synchronous, so the
# promoted standby does not wait for a standby of its own.
my $standby = new_standby($primary, 'sync_standby', port => 55462);
alter_system($primary, 'synchronous_standby_names', 'sync_standby');
ok( $primary->poll_query_until(
		'postgres',
		"SELECT sync_state = 'sync' FROM pg_stat_replication "
		  . "WHERE application_name = 'sync_standby'"),
	'the standby is synchronous');

sub sql { return $primary->safe_psql('postgres', $_[0]); }

my @seen;    # every token a client saw from the primary

# A commit waits for the standby, which confirms it.
my $c = finish_key($primary, 'postgres', 'before', '1 day');
is($c->{outcome}, 'claimed', 'a key claimed and finished with the standby up is committed');
push @seen, $c->{token};
$primary->wait_for_catchup($standby);

$standby->stop;

# Start "$select" in an open transaction of a session of its own, and
# return once the call waits (on wait event $event, SyncRep if not given)
# or has returned.  The condition names the call's query, so that the
# session's BEGIN does not count as returned.
sub start_call
{
	my ($what, $select, $match, $event) = @_;
	$event //= 'SyncRep';
	my $s = $primary->background_psql('postgres', on_error_stop => 0);
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	$s->query_safe('BEGIN');
	my $buf = $s->query_until(qr/started\n/,
		"\\set VERBOSITY verbose\n\\echo started\n$select;\n\\echo done\n");
	my $call = { what => $what, s => $s, pid => $pid, buf => $buf };
	ok( $primary->poll_query_until(
			'postgres',
			"SELECT query LIKE '%$match%' AND (wait_event IS NOT DISTINCT FROM '$event' "
			  . "OR state <> 'active') FROM pg_stat_activity WHERE pid = $pid"),
		"$what: the call waits or has returned");
	$call->{waiting} = sql("SELECT coalesce(wait_event, state) FROM pg_stat_activity "
		  . "WHERE pid = $pid") eq $event;
	ok($call->{waiting}, "$what: the call waits ($event)");
	return $call;
}

# The call is still running: no output yet, its backend active.
sub still_waiting
{
	my ($call) = @_;
	$call->{s}{run}->pump_nb;
	unlike($call->{buf} . $call->{s}{stdout}, qr/done\n/,
		"$call->{what}: the call has not returned");
	is(sql("SELECT state FROM pg_stat_activity WHERE pid = $call->{pid}"),
		'active', "$call->{what}: its backend still runs it");
}

# Until the call has returned: what it printed, its lines.
sub call_output
{
	my ($call) = @_;
	my $out = $call->{buf} . $call->{s}->query_until(qr/done\n/, '');
	$out =~ s/^.*?started\n//s;
	$out =~ s/\n?done\n.*//s;
	return $out;
}

# --- a cancel during the wait --------------------------------------------------
my $cancel = start_call('cancel',
	"SELECT token FROM idempotency.idem_claim('cancelled', scope => 'sync')",
	"idem_claim(''cancelled''");
if ($cancel->{waiting})
{
	still_waiting($cancel);
	is(sql("SELECT pg_cancel_backend($cancel->{pid})"), 't', 'cancel: pg_cancel_backend signals the waiting backend');
}
my $out = call_output($cancel);
push @seen, grep { /^\d+$/ } split /\n/, $out;
is($out, '', 'cancel: the call returns no token');
like($cancel->{s}{stderr}, qr/ERROR:\s+57014:/, 'cancel: the call fails with 57014');
$cancel->{s}->query('ROLLBACK');
$cancel->{s}->quit;

# --- a claim that waits for another session's refill --------------------------
my $refiller = start_call('refiller',
	"SELECT token FROM idempotency.idem_claim('refiller', scope => 'sync')",
	"idem_claim(''refiller''");
my $waiter = start_call('waiter',
	"SELECT token FROM idempotency.idem_claim('waiter', scope => 'sync')",
	"idem_claim(''waiter''", 'Extension');
if ($refiller->{waiting})
{
	is(sql("SELECT pg_cancel_backend($refiller->{pid})"), 't',
		'refiller: pg_cancel_backend signals the refilling backend');
}
$out = call_output($refiller);
push @seen, grep { /^\d+$/ } split /\n/, $out;
is($out, '', 'refiller: the call returns no token');
like($refiller->{s}{stderr}, qr/ERROR:\s+57014:/, 'refiller: the call fails with 57014');
$refiller->{s}->query('ROLLBACK');
$refiller->{s}->quit;
ok( $primary->poll_query_until(
		'postgres',
		"SELECT wait_event IS NOT DISTINCT FROM 'SyncRep' OR state <> 'active' "
		  . "FROM pg_stat_activity WHERE pid = $waiter->{pid}"),
	'waiter: the call waits or has returned');
is(sql("SELECT coalesce(wait_event, state) FROM pg_stat_activity "
		. "WHERE pid = $waiter->{pid}"), 'SyncRep',
	'waiter: the call now refills itself and waits for the synchronous standby');
still_waiting($waiter);

# --- a batch of 40 tokens --------------------------------------------------------
my @keys = map { "f$_" } 1 .. 40;
my $batch = start_call('batch',
	"SELECT token FROM idempotency.idem_claim_many(ARRAY['"
	  . join("', '", @keys)
	  . "'], scope => 'sync') ORDER BY ord",
	'idem_claim_many', 'Extension');
if ($batch->{waiting})
{
	still_waiting($batch);
	# Their tokens leave once the standby has confirmed their records.
	$standby->start;
}
my @tokens = split /\n/, call_output($batch);
is(scalar(grep { /^\d+$/ } @tokens), 40, 'batch: the call returns 40 tokens');
cmp_ok(min(@tokens), '>', max(@seen), 'batch: its tokens are above the earlier ones');
my @waited = grep { /^\d+$/ } split /\n/, call_output($waiter);
is(scalar(@waited), 1, 'waiter: the call returns its token');
cmp_ok($waited[0], '>', max(@seen), 'waiter: its token is above the earlier ones');
push @seen, @tokens, @waited;
my %count;
$count{$_}++ for @seen;
is(join(',', grep { $count{$_} > 1 } keys %count), '', 'no token is handed out twice');

# --- failover, the batch's transaction still open ----------------------------
$primary->stop('immediate');
$batch->{s}{run}->kill_kill;
$waiter->{s}{run}->kill_kill;
$standby->start unless $batch->{waiting};
$standby->promote;
ok($standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'the standby is promoted');
my $new = $standby;

my @after = split /\n/,
  $new->safe_psql('postgres',
	"SELECT token FROM idempotency.idem_claim_many("
	  . "ARRAY['after-1', 'after-2', 'after-3'], scope => 'sync') ORDER BY ord");
$c = claim($new, 'postgres', "'after-4', scope => 'sync'");
is($c->{outcome}, 'claimed', 'new primary: a single claim is claimed');
push @after, $c->{token};
is(scalar(grep { /^\d+$/ } @after), 4, 'new primary: 4 tokens issued');
my %seen = map { $_ => 1 } @seen;
is(join(',', grep { $seen{$_} } @after), '',
	'new primary: no token a client saw is issued again');
cmp_ok(min(@after), '>', max(@seen),
	'new primary: every token issued is above every token a client saw');
is( $new->safe_psql('postgres',
		"SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys "
		  . "WHERE scope = 'sync'"),
	'after-1,after-2,after-3,after-4',
	'new primary: nothing of the open transactions is stored');
like(stored_row($new, 'postgres', '', 'before'), qr/^succeeded\|$seen[0]\|1\|/,
	'new primary: the key committed before is stored as it was');

$new->stop;
done_testing();
